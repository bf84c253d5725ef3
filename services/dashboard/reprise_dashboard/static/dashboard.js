// Live updates for the Reprise dashboard: listen to /events (server-sent events) and, when a change concerns this
// page, fetch the page again and swap in its live sections ([data-live] with an id). The server renders everything;
// this file only decides when to ask for it. No dependencies, no build step.
(function () {
  "use strict";

  const body = document.body;
  const topics = (body.dataset.liveTopics || "").split(/\s+/).filter(Boolean);
  const onlyJob = body.dataset.liveJob || "";
  const refreshEvery = Number(body.dataset.refreshS || "0");
  const status = document.getElementById("live-status");
  const stats = { events: 0, refreshes: 0 };
  window.repriseLive = stats;

  let inFlight = false;
  let again = false;
  let timer = null;

  function setState(state, text) {
    body.dataset.liveState = state;
    if (status) {
      status.textContent = text;
      status.className = "live-status " + state;
    }
  }

  function openDetails(root) {
    // Which <details> a person opened, so a refresh does not close them under their eyes.
    const open = new Set();
    root.querySelectorAll("details[open]").forEach(function (d) {
      const owner = d.closest("[data-key]");
      open.add((owner ? owner.dataset.key : "") + "|" + (d.querySelector("summary") || {}).textContent);
    });
    return open;
  }

  function swap(fresh) {
    document.querySelectorAll("[data-live][id]").forEach(function (old) {
      const replacement = fresh.getElementById(old.id);
      if (!replacement) return;
      const known = new Set(Array.from(old.querySelectorAll("[data-key]"), (el) => el.dataset.key));
      const open = openDetails(old);
      const node = document.importNode(replacement, true);
      node.querySelectorAll("[data-key]").forEach(function (el) {
        if (!known.has(el.dataset.key)) el.classList.add("fresh");
      });
      node.querySelectorAll("details").forEach(function (d) {
        const owner = d.closest("[data-key]");
        const key = (owner ? owner.dataset.key : "") + "|" + (d.querySelector("summary") || {}).textContent;
        if (open.has(key)) d.open = true;
      });
      old.replaceWith(node);
    });
  }

  async function refresh() {
    if (inFlight) {
      again = true; // a change arrived while fetching: fetch once more after this one
      return;
    }
    inFlight = true;
    try {
      const response = await fetch(window.location.href, { cache: "no-store", headers: { Accept: "text/html" } });
      if (response.ok) {
        swap(new DOMParser().parseFromString(await response.text(), "text/html"));
        stats.refreshes += 1;
        body.dataset.liveRefreshes = String(stats.refreshes);
      }
    } catch (err) {
      // The dashboard itself is unreachable; the event stream's reconnect will bring a refresh.
    } finally {
      inFlight = false;
      if (again) {
        again = false;
        schedule();
      }
    }
  }

  function schedule() {
    // Changes come in bursts (one per recovery step): one refresh shortly after the first is enough.
    if (timer !== null) return;
    timer = window.setTimeout(function () {
      timer = null;
      refresh();
    }, 200);
  }

  function concernsThisPage(topic, message) {
    if (!topics.includes(topic)) return false;
    return !onlyJob || message.job_id === onlyJob;
  }

  if (!window.EventSource || topics.length === 0) {
    setState("off", "live updates off");
  } else {
    const source = new EventSource("/events");
    let dropped = false;
    source.onopen = function () {
      setState("open", "● live");
      if (dropped) schedule(); // catch up on what happened while the stream was down
      dropped = false;
    };
    source.onerror = function () {
      dropped = true;
      setState("reconnecting", "○ reconnecting…");
    };
    ["incident", "recovery"].forEach(function (topic) {
      source.addEventListener(topic, function (event) {
        let message = {};
        try {
          message = JSON.parse(event.data);
        } catch (err) {
          return;
        }
        stats.events += 1;
        if (concernsThisPage(topic, message)) schedule();
      });
    });
  }

  if (refreshEvery > 0) window.setInterval(schedule, refreshEvery * 1000);
})();
