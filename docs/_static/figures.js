// On a narrow screen a figure shrunk to the column would shrink its text out of reading size (the notebooks draw
// their figures at 150 dpi, 7-10 inches wide). Each figure keeps at least 60% of its drawn size; its output box
// scrolls sideways instead of the page (site.css).
(function () {
    "use strict";
    var SCALE = 0.6;
    function keep(img) {
        if (img.naturalWidth) {
            img.style.setProperty("--figure-min-width", Math.round(img.naturalWidth * SCALE) + "px");
        }
    }
    function all() {
        document.querySelectorAll("div.cell_output img, .static-widget img").forEach(function (img) {
            if (img.complete) { keep(img); } else { img.addEventListener("load", function () { keep(img); }); }
        });
    }
    if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", all); } else { all(); }
})();
