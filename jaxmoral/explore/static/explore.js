// Sorting (click a header) and filtering (selects with data-filter) of server-rendered tables.
"use strict";

function cellValue(row, index, type) {
  const text = row.cells[index] ? row.cells[index].textContent.trim() : "";
  if (type === "num") {
    const value = parseFloat(text);
    return Number.isNaN(value) ? -Infinity : value;
  }
  return text.toLowerCase();
}

function sortTable(table, index, header) {
  const body = table.tBodies[0];
  const type = header.dataset.type || "text";
  const ascending = !header.classList.contains("sorted-asc");
  for (const th of header.parentNode.children) th.classList.remove("sorted-asc", "sorted-desc");
  header.classList.add(ascending ? "sorted-asc" : "sorted-desc");
  const rows = Array.from(body.rows);
  rows.sort((a, b) => {
    const x = cellValue(a, index, type), y = cellValue(b, index, type);
    return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
  });
  for (const row of rows) body.appendChild(row);
}

function applyFilters(box) {
  const table = document.getElementById(box.dataset.table);
  if (!table) return;
  const wanted = {};
  for (const select of box.querySelectorAll("select[data-filter]")) {
    if (select.value) wanted[select.dataset.filter] = select.value;
  }
  let shown = 0;
  for (const row of table.tBodies[0].rows) {
    const keep = Object.entries(wanted).every(([key, value]) => row.dataset[key] === value);
    row.hidden = !keep;
    if (keep) shown += 1;
  }
  const count = box.querySelector("[data-count-for]");
  if (count) count.textContent = shown + " of " + table.tBodies[0].rows.length + " examples";
}

document.addEventListener("DOMContentLoaded", () => {
  for (const table of document.querySelectorAll("table.sortable")) {
    const headers = table.tHead ? table.tHead.rows[0].cells : [];
    Array.from(headers).forEach((header, index) => {
      header.addEventListener("click", () => sortTable(table, index, header));
    });
  }
  for (const box of document.querySelectorAll(".filters[data-table]")) {
    for (const select of box.querySelectorAll("select[data-filter]")) {
      select.addEventListener("change", () => applyFilters(box));
    }
    applyFilters(box);
  }
});
