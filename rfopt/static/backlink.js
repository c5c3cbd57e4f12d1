// Added to optuna-dashboard's pages by rfopt's dashboard (rfopt/dashboard/server.py, _Backlink): the "rfopt page"
// link leads to rfopt's page of the study optuna-dashboard shows, or to rfopt's list of studies.
"use strict";
(function () {
  const link = document.getElementById("rfopt-backlink");
  if (!link) return;
  const follow = () => {
    const match = location.pathname.match(/^\/dashboard\/studies\/(\d+)/);
    link.href = match ? `/rfopt/studies/${match[1]}` : "/rfopt";
    link.title = match ? "this study on rfopt's page: leaderboard, what trains now, controls" : "rfopt's studies";
  };
  follow();
  setInterval(follow, 1000); // the single-page app changes the address without reloading
})();
