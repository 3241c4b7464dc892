// Figures fit the column (site.css: max-width 100%): on a phone a figure is shrunk to the screen, never cut off
// or hidden in a sideways box. Each figure is a link that opens it at its full drawn size, for its small print:
// a link, so Tab reaches it and Enter follows it (a click handler on the image alone served the mouse only).
(function () {
    "use strict";
    var HINT = "open the figure at full size";
    function openFull(event) {
        // A static widget's image is a data: URL, which browsers refuse to open as a page: open it as a blob.
        var src = this.getAttribute("href");
        if (src.indexOf("data:") !== 0) { return; }
        event.preventDefault();
        fetch(src).then(function (r) { return r.blob(); })
            .then(function (blob) { window.open(URL.createObjectURL(blob), "_blank", "noopener"); });
    }
    function zoomable(img) {
        if (img.closest("a")) { return; }  // already a link
        var link = document.createElement("a");
        link.className = "figure-zoom";
        link.href = img.getAttribute("src");
        link.target = "_blank";
        link.rel = "noopener";
        link.title = HINT;
        link.addEventListener("click", openFull);
        img.parentNode.insertBefore(link, img);
        link.appendChild(img);  // the link's name is the image's alt text: what the figure shows
    }
    function all() {
        document.querySelectorAll("div.cell_output img, .static-widget img").forEach(zoomable);
    }
    if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", all); } else { all(); }
})();
