// Figures fit the column (site.css: max-width 100%): on a phone a figure is shrunk to the screen, never cut off
// or hidden in a sideways box. Tapping a figure opens it at its full drawn size, for its small print.
(function () {
    "use strict";
    function zoomable(img) {
        if (img.closest("a")) { return; }  // already a link
        img.title = img.title || "open the figure at full size";
        img.addEventListener("click", function () { window.open(img.src, "_blank"); });
    }
    function all() {
        document.querySelectorAll("div.cell_output img, .static-widget img").forEach(zoomable);
    }
    if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", all); } else { all(); }
})();
