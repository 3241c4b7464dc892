// pydata-sphinx-theme (0.17 and later) gives its sidebar behaviour to the first .primary-toggle and
// .secondary-toggle of a page: its own navbar's buttons, which sphinx-book-theme hides. The buttons a reader
// sees are the book theme's, in the article's header, and did nothing (pydata-sphinx-theme issue 2451): on a
// phone the table of contents could not be opened. A click on one of them is handed to the bound button.
(function () {
    "use strict";
    function forward(selector) {
        var buttons = document.querySelectorAll(selector);
        for (var i = 1; i < buttons.length; i++) {
            buttons[i].addEventListener("click", function (event) {
                event.preventDefault();
                event.stopPropagation();
                buttons[0].click();  // the drawer on a narrow screen, folding the sidebar away on a wide one
            });
        }
    }
    function setUp() { forward(".primary-toggle"); forward(".secondary-toggle"); }
    if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", setUp); } else { setUp(); }
})();
