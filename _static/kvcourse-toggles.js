/* kvcourse: make every sidebar toggle work.
 *
 * pydata-sphinx-theme 0.17 and sphinx-book-theme 1.3 each bind their sidebar handlers to the FIRST
 * `.primary-toggle` / `.secondary-toggle` on the page, a button hidden in the header; the toggles a
 * reader sees (the article header's menu button and "Contents") get nothing, so on a phone the menu
 * never opened (pydata-sphinx-theme issue 2451, sphinx-book-theme issue 988). Each visible toggle
 * forwards its click to the first one, which opens the sidebar dialog on a narrow screen and collapses
 * the sidebar on a wide one, as the themes intend. tests/test_browser.py opens the menu at phone width.
 */
(function () {
  function forward(selector) {
    const toggles = Array.from(document.querySelectorAll(selector));
    const first = toggles[0];
    toggles.slice(1).forEach((button) => {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        first.click();
      });
    });
  }
  function setup() {
    forward(".primary-toggle");
    forward(".secondary-toggle");
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setup);
  } else {
    setup();
  }
})();
