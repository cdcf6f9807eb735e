#include "cli/run_page.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include <nlohmann/json.hpp>

#include "loom/formats/jinja.hpp"
#include "cli/run_command.hpp"
#include "loom/devices.hpp"
#include "loom/error.hpp"
#include "loom/kit/atomic_file.hpp"
#include "loom/kit/json.hpp"
#include "runtime/metrics_sink.hpp"

namespace loom::core {
namespace fs = std::filesystem;
namespace {

// A curve keeps at most this many points on the page (every Nth, and the last), so a long run's
// page stays small and quick to draw.
constexpr std::size_t kMaxPointsPerCurve = 3000;

using Json = nlohmann::json;

std::string dump(const Json& value, int indent = -1) { return value.dump(indent, ' ', false, Json::error_handler_t::replace); }

std::string escape(const std::string& text) { return formats::jinja::html_escape(text); }

// A manifest value as text: a string as it is, anything else as JSON.
std::string text_of(const Json& value) { return value.is_string() ? value.get<std::string>() : dump(value); }
std::string html_of(const Json& value) { return escape(text_of(value)); }

// A value at a path of object keys, or null when any step is missing.
const Json& at_path(const Json& root, std::initializer_list<const char*> keys) {
  static const Json null;
  const Json* at = &root;
  for (const char* key : keys) {
    if (!at->is_object() || !at->contains(key)) return null;
    at = &(*at)[key];
  }
  return *at;
}

std::string bytes_of(const Json& value) { return value.is_number_unsigned() || value.is_number_integer() ? format_bytes(value.get<std::uint64_t>()) : "-"; }

std::string number(double value, const char* format = "%.4g") {
  if (!std::isfinite(value)) return std::isnan(value) ? "NaN" : (value > 0 ? "inf" : "-inf");
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

struct Series {
  std::string tag;
  std::vector<std::int64_t> steps;
  std::vector<float> values;
};

struct Metrics {
  std::vector<Json> train, eval;  // the rows, in the file's order
  std::vector<Series> series;     // every scalar, train tags first, in order of first appearance
  std::size_t damaged_lines = 0;
};

Metrics read_metrics(const fs::path& file) {
  Metrics m;
  std::map<std::string, std::size_t> index;
  for_each_metrics_line(file, [&](const std::string& line, const Json* row) {
    if (!row) {
      m.damaged_lines += line.empty() ? 0 : 1;  // a blank line is no row, and nothing lost
      return true;
    }
    const auto step = (*row)["step"].get<std::int64_t>();
    for (const auto& [tag, value] : metric_scalars(*row)) {
      auto [it, added] = index.emplace(tag, m.series.size());
      if (added) m.series.push_back({tag, {}, {}});
      m.series[it->second].steps.push_back(step);
      m.series[it->second].values.push_back(value);
    }
    (is_eval_row(*row) ? m.eval : m.train).push_back(*row);
    return true;
  });
  std::stable_partition(m.series.begin(), m.series.end(), [](const Series& s) { return s.tag.rfind("train/", 0) == 0; });
  return m;
}

// The curves as the page's script reads them: [{tag, steps, values, every}] (every: 1 when each
// point is kept, else the stride).
Json series_json(const Metrics& m) {
  Json out = Json::array();
  for (const auto& s : m.series) {
    const std::size_t n = s.steps.size();
    const std::size_t every = n <= kMaxPointsPerCurve ? 1 : (n + kMaxPointsPerCurve - 1) / kMaxPointsPerCurve;
    Json steps = Json::array(), values = Json::array();
    for (std::size_t i = 0; i < n; ++i)
      if (i % every == 0 || i + 1 == n) {
        steps.push_back(s.steps[i]);
        values.push_back(std::isfinite(s.values[i]) ? Json(s.values[i]) : Json());  // a gap in the curve
      }
    out.push_back({{"tag", s.tag}, {"steps", steps}, {"values", values}, {"every", every}, {"points", n}});
  }
  return out;
}

// "embed, layers.0-15, norm": a device's blocks with runs of numbered layers folded.
std::string fold_blocks(const std::vector<std::string>& blocks) {
  std::string out;
  std::size_t i = 0;
  const auto layer_number = [](const std::string& name, std::string& prefix) -> long {
    const auto dot = name.rfind('.');
    if (dot == std::string::npos || dot + 1 == name.size() || name.find_first_not_of("0123456789", dot + 1) != std::string::npos) return -1;
    prefix = name.substr(0, dot + 1);
    return std::stol(name.substr(dot + 1, 9));
  };
  while (i < blocks.size()) {
    std::string prefix, next_prefix;
    const long first = layer_number(blocks[i], prefix);
    std::size_t j = i + 1;
    if (first >= 0)
      while (j < blocks.size() && layer_number(blocks[j], next_prefix) == first + static_cast<long>(j - i) && next_prefix == prefix) ++j;
    out += (out.empty() ? "" : ", ") + (j - i > 1 ? blocks[i] + "-" + std::to_string(first + static_cast<long>(j - i - 1)) : blocks[i]);
    i = j;
  }
  return out;
}

// The largest peak each device reached over the run's rows ("cuda:0", "rank 1 cuda:0", ...).
std::map<std::string, std::uint64_t> measured_peaks(const Metrics& m) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& row : m.train) {
    const Json& peaks = at_path(row, {"peak_memory_bytes"});
    if (!peaks.is_object()) continue;
    for (const auto& [device, bytes] : peaks.items())
      if (bytes.is_number_unsigned() || bytes.is_number_integer()) out[device] = std::max(out[device], bytes.get<std::uint64_t>());
  }
  return out;
}

std::string plan_section(const Json& manifest, const Metrics& m) {
  const Json& plan = at_path(manifest, {"plan"});
  std::string html = "<section id=\"plan\"><h2>Plan</h2>";
  if (!plan.is_object()) return html + "<p>run.json holds no plan.</p></section>";
  const Json& mesh = at_path(plan, {"mesh"});
  html += "<p>strategy <b>" + html_of(at_path(plan, {"strategy"})) + "</b>, dtype " + html_of(at_path(plan, {"dtype"})) + ", batch " +
          html_of(at_path(plan, {"batch_size"})) + " x " + html_of(at_path(plan, {"seq_len"})) + " tokens";
  if (mesh.is_object())
    html += ", mesh data " + html_of(at_path(mesh, {"data"})) + " x pipeline " + html_of(at_path(mesh, {"pipeline"})) + " x tensor " +
            html_of(at_path(mesh, {"tensor"}));
  html += "</p>";

  std::map<std::pair<std::int64_t, std::string>, std::vector<std::string>> blocks;
  if (const Json& ranks = at_path(plan, {"ranks"}); ranks.is_array())
    for (const auto& rank : ranks)
      if (rank.is_object() && rank.contains("rank") && rank["rank"].is_number_integer())
        for (const auto& b : at_path(rank, {"blocks"}))
        if (b.is_object() && b.contains("block") && b.contains("device"))
          blocks[{rank["rank"].get<std::int64_t>(), text_of(b["device"])}].push_back(text_of(b["block"]));

  const auto peaks = measured_peaks(m);
  const std::int64_t world = at_path(mesh, {"world"}).is_number_integer() ? at_path(mesh, {"world"}).get<std::int64_t>() : 1;
  html += "<table class=\"plan\"><thead><tr><th>rank</th><th>device</th><th>blocks</th><th>weights</th><th>trainable state</th>"
          "<th>activations</th><th>working</th><th>planned</th><th>measured peak</th><th>capacity</th></tr></thead><tbody>";
  const Json& devices = at_path(plan, {"devices"});
  for (const auto& d : devices.is_array() ? devices : Json::array()) {
    if (!d.is_object()) continue;
    const std::int64_t rank = at_path(d, {"rank"}).is_number_integer() ? d["rank"].get<std::int64_t>() : 0;
    const std::string device = text_of(at_path(d, {"device"}));
    const std::string key = peak_memory_key(static_cast<int>(world), rank, device);
    const auto peak = peaks.find(key);
    const auto held = blocks.find({rank, device});
    html += "<tr data-device=\"" + escape(key) + "\"><td>" + std::to_string(rank) + "</td><td>" + escape(device) + "</td><td>" +
            escape(held == blocks.end() ? std::string("-") : fold_blocks(held->second)) + "</td><td>" + bytes_of(at_path(d, {"weights_bytes"})) +
            "</td><td>" + bytes_of(at_path(d, {"trainable_state_bytes"})) + "</td><td>" + bytes_of(at_path(d, {"activations_bytes"})) +
            "</td><td>" + bytes_of(at_path(d, {"working_bytes"})) + "</td><td>" + bytes_of(at_path(d, {"total_bytes"})) + "</td><td>" +
            (peak == peaks.end() ? std::string("-") : format_bytes(peak->second)) + "</td><td>" + bytes_of(at_path(d, {"capacity_bytes"})) +
            "</td></tr>";
  }
  html += "</tbody></table>";
  if (peaks.empty()) html += "<p class=\"note\">Peaks are measured on CUDA devices only.</p>";
  if (const Json& notes = at_path(plan, {"notes"}); notes.is_array() && !notes.empty()) {
    html += "<ul class=\"notes\">";
    for (const auto& n : notes) html += "<li>" + html_of(n) + "</li>";
    html += "</ul>";
  }
  return html + "</section>";
}

std::string outputs_section(const fs::path& dir) {
  std::error_code ec;
  std::string html = "<section id=\"outputs\"><h2>Outputs</h2><table class=\"outputs\"><tbody>";
  const auto row = [&](const std::string& what, const fs::path& path, const std::string& about) {
    html += "<tr><th>" + escape(what) + "</th><td><code>" + escape(path.string()) + "</code></td><td>" + about + "</td></tr>";
  };
  if (fs::is_directory(dir / "adapter", ec)) {
    std::string about = "PEFT format";
    try {
      const Json config = kit::json::read_file(dir / "adapter" / "adapter_config.json", 1u << 20, "adapter config");
      about += ": " + html_of(at_path(config, {"peft_type"})) + " r " + html_of(at_path(config, {"r"})) + ", alpha " +
               html_of(at_path(config, {"lora_alpha"})) + ", targets " + html_of(at_path(config, {"target_modules"}));
    } catch (const UserError&) {
      about += " (no readable adapter_config.json)";
    }
    row("adapter", dir / "adapter", about);
  }
  if (fs::is_directory(dir / "merged", ec)) row("merged weights", dir / "merged", "Hugging Face format");
  if (fs::is_directory(dir / "model", ec)) row("weights", dir / "model", "Hugging Face format");
  row("metrics", dir / "metrics.jsonl", "one JSON object a line");
  if (fs::exists(dir / MetricsSink::kEventFile, ec))
    row("TensorBoard", dir / MetricsSink::kEventFile, "<code>tensorboard --logdir " + escape(dir.string()) + "</code>");
  std::vector<std::string> checkpoints;
  if (fs::is_directory(dir / "checkpoints", ec))
    for (const auto& entry : fs::directory_iterator(dir / "checkpoints", ec))
      if (entry.is_directory(ec) && entry.path().filename().string().rfind("step-", 0) == 0) checkpoints.push_back(entry.path().filename().string());
  std::sort(checkpoints.begin(), checkpoints.end());
  std::string names;
  for (const auto& c : checkpoints) names += (names.empty() ? "" : ", ") + escape(c);
  if (!checkpoints.empty()) row("checkpoints", dir / "checkpoints", names);
  return html + "</tbody></table></section>";
}

std::string manifest_section(const Json& manifest) {
  std::string html = "<section id=\"manifest\"><h2>Manifest</h2><table class=\"manifest\"><tbody>";
  const auto row = [&](const std::string& what, const std::string& value_html) {
    html += "<tr><th>" + escape(what) + "</th><td>" + value_html + "</td></tr>";
  };
  std::string command;
  if (const Json& argv = at_path(manifest, {"command"}); argv.is_array())
    for (const auto& word : argv) command += (command.empty() ? "" : " ") + text_of(word);
  row("command", "<code>" + escape(command) + "</code>");
  row("created", html_of(at_path(manifest, {"created"})));
  row("pipeline file", "<code>" + html_of(at_path(manifest, {"pipeline_file"})) + "</code>");
  row("seed", html_of(at_path(manifest, {"seed"})));
  std::string versions;
  if (const Json& v = at_path(manifest, {"versions"}); v.is_object())
    for (const auto& [name, value] : v.items()) versions += (versions.empty() ? "" : ", ") + escape(name) + " " + html_of(value);
  row("versions", versions);
  if (const Json& plugins = at_path(manifest, {"plugins"}); plugins.is_object())
    for (const auto& [section, p] : plugins.items())
      row("[" + section + "]", "<b>" + html_of(at_path(p, {"name"})) + "</b> " + html_of(at_path(p, {"version"})) + " (SDK " +
                                   html_of(at_path(p, {"sdk"})) + ", LibTorch " + html_of(at_path(p, {"torch"})) + ") <code>" +
                                   html_of(at_path(p, {"file"})) + "</code>");
  std::string devices;
  if (const Json& d = at_path(manifest, {"devices", "devices"}); d.is_array())
    for (const auto& device : d)
      devices += (devices.empty() ? "" : "; ") + html_of(at_path(device, {"device"})) + " " + bytes_of(at_path(device, {"capacity_bytes"})) +
                 " (" + html_of(at_path(device, {"description"})) + ")";
  row("devices", devices);
  html += "</tbody></table><details><summary>the pipeline as run (every key resolved)</summary><pre>" + escape(dump(at_path(manifest, {"pipeline"}), 2)) +
          "</pre></details></section>";
  return html;
}

std::string summary_section(const Json& manifest, const Metrics& m) {
  const Json& max_steps = at_path(manifest, {"pipeline", "train", "max_steps"});
  std::string html = "<section id=\"summary\"><div class=\"cards\">";
  const auto card = [&](const std::string& label, const std::string& value) {
    html += "<div class=\"card\"><div class=\"label\">" + escape(label) + "</div><div class=\"value\">" + escape(value) + "</div></div>";
  };
  if (!m.train.empty()) {
    const Json& last = m.train.back();
    card("step", text_of(last["step"]) + (max_steps.is_number_integer() ? " of " + text_of(max_steps) : ""));
    if (const Json& loss = at_path(last, {"loss"}); loss.is_number()) card("training loss", number(loss.get<double>()));
    double rate = 0;
    std::size_t rated = 0;
    for (const auto& row : m.train)
      if (const Json& r = at_path(row, {"tokens_per_s"}); r.is_number()) rate += r.get<double>(), ++rated;
    if (rated > 0) card("tokens/s (mean)", number(rate / static_cast<double>(rated), "%.0f"));
  } else {
    card("step", "no metrics yet");
  }
  if (!m.eval.empty()) {
    const Json& last = m.eval.back();
    if (const Json& loss = at_path(last, {"eval_loss"}); loss.is_number()) card("held-out loss", number(loss.get<double>()));
    if (const Json& exact = at_path(last, {"exact_match"}); exact.is_number()) card("exact-match", number(100 * exact.get<double>(), "%.1f") + "%");
  }
  for (const auto& [device, bytes] : measured_peaks(m)) card("peak " + device, format_bytes(bytes));
  html += "</div>";
  if (m.damaged_lines > 0)
    html += "<p class=\"note\">" + std::to_string(m.damaged_lines) + " line(s) of metrics.jsonl could not be read (a run stopped mid-write) and are left out.</p>";
  return html + "</section>";
}

// Draws a chart per curve from the data block: an SVG with axes, ticks, the curve as one path
// (gaps where a value was not finite) and the value under the pointer. The body's data-charts says
// how many were drawn, so a test can tell that the script ran.
constexpr const char* kScript = R"JS(
(function () {
  const data = JSON.parse(document.getElementById('loom-data').textContent);
  const NS = 'http://www.w3.org/2000/svg';
  const W = 460, H = 250, L = 64, R = 14, T = 14, B = 34;
  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    const a = Math.abs(v);
    if (v === 0) return '0';
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
    return String(+v.toPrecision(4));
  }
  function ticks(lo, hi, count) {
    const span = hi - lo;
    const raw = span / count, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
    const step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    return out;
  }
  const grid = document.getElementById('charts');
  let drawn = 0;
  for (const s of data.series) {
    const finite = [];
    s.values.forEach((v, i) => { if (v !== null) finite.push([s.steps[i], v]); });
    const box = document.createElement('figure');
    box.className = 'chart';
    const caption = document.createElement('figcaption');
    caption.textContent = s.tag + (s.every > 1 ? ' (every ' + s.every + 'th of ' + s.points + ' points)' : '');
    box.appendChild(caption);
    const svg = el('svg', {viewBox: '0 0 ' + W + ' ' + H, width: W, height: H, 'data-tag': s.tag, 'data-points': finite.length, role: 'img'});
    el('title', {}, svg).textContent = s.tag;
    box.appendChild(svg);
    grid.appendChild(box);
    if (finite.length === 0) { el('text', {x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'empty'}, svg).textContent = 'no finite values'; drawn++; continue; }
    let x0 = Math.min(...finite.map(p => p[0])), x1 = Math.max(...finite.map(p => p[0]));
    let y0 = Math.min(...finite.map(p => p[1])), y1 = Math.max(...finite.map(p => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const px = x => L + (x - x0) / (x1 - x0) * (W - L - R);
    const py = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
    for (const t of ticks(y0, y1, 5)) {
      el('line', {x1: L, x2: W - R, y1: py(t), y2: py(t), class: 'grid'}, svg);
      el('text', {x: L - 6, y: py(t) + 4, 'text-anchor': 'end', class: 'tick'}, svg).textContent = fmt(t);
    }
    for (const t of ticks(x0, x1, 5)) {
      if (t !== Math.round(t)) continue;
      el('line', {x1: px(t), x2: px(t), y1: H - B, y2: H - B + 4, class: 'axis'}, svg);
      el('text', {x: px(t), y: H - B + 17, 'text-anchor': 'middle', class: 'tick'}, svg).textContent = fmt(t);
    }
    el('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, class: 'axis'}, svg);
    el('line', {x1: L, x2: L, y1: T, y2: H - B, class: 'axis'}, svg);
    el('text', {x: W - R, y: H - 4, 'text-anchor': 'end', class: 'tick'}, svg).textContent = 'step';
    let d = '', pen = 'M';
    s.values.forEach((v, i) => {
      if (v === null) { pen = 'M'; return; }
      d += pen + px(s.steps[i]).toFixed(1) + ' ' + py(v).toFixed(1) + ' ';
      pen = 'L';
    });
    el('path', {d: d.trim(), class: 'curve'}, svg);
    if (finite.length === 1) el('circle', {cx: px(finite[0][0]), cy: py(finite[0][1]), r: 3, class: 'dot'}, svg);
    const marker = el('circle', {r: 4, class: 'marker', visibility: 'hidden'}, svg);
    const readout = el('text', {x: L + 6, y: T + 12, class: 'readout'}, svg);
    svg.addEventListener('mousemove', ev => {
      const r = svg.getBoundingClientRect();
      const x = x0 + ((ev.clientX - r.left) * W / r.width - L) / (W - L - R) * (x1 - x0);
      let best = finite[0];
      for (const p of finite) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
      marker.setAttribute('cx', px(best[0]));
      marker.setAttribute('cy', py(best[1]));
      marker.setAttribute('visibility', 'visible');
      readout.textContent = 'step ' + best[0] + ': ' + fmt(best[1]);
    });
    svg.addEventListener('mouseleave', () => { marker.setAttribute('visibility', 'hidden'); readout.textContent = ''; });
    drawn++;
  }
  if (data.series.length === 0) grid.textContent = 'No metrics yet: the run has not logged a step.';
  document.body.setAttribute('data-charts', String(drawn));
})();
)JS";

constexpr const char* kStyle = R"CSS(
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1480px; padding: 0 16px; color: #1d2330; background: #fbfbfd; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 10px; border-bottom: 1px solid #dde1ea; padding-bottom: 4px; }
.sub { color: #5b6478; } code, pre { font: 12.5px ui-monospace, monospace; } pre { background: #f0f2f6; padding: 10px; overflow: auto; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 16px; }
.card { background: #fff; border: 1px solid #dde1ea; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card .label { color: #5b6478; font-size: 12px; } .card .value { font-size: 19px; font-weight: 600; }
#charts { display: flex; flex-wrap: wrap; gap: 12px; } figure.chart { margin: 0; background: #fff; border: 1px solid #dde1ea; border-radius: 6px; padding: 6px; }
figcaption { font-weight: 600; font-size: 13px; padding: 0 0 2px 6px; }
svg .curve { fill: none; stroke: #2f6fde; stroke-width: 1.6; } svg .grid { stroke: #eceef3; } svg .axis { stroke: #9aa2b4; }
svg .tick { font-size: 11px; fill: #5b6478; } svg .readout { font-size: 12px; fill: #1d2330; } svg .marker, svg .dot { fill: #d6453d; }
table { border-collapse: collapse; background: #fff; } th, td { border: 1px solid #dde1ea; padding: 4px 8px; text-align: left; vertical-align: top; }
table.plan td:nth-child(n+4) { text-align: right; white-space: nowrap; } .note { color: #8a5a00; }
)CSS";

}  // namespace

std::string run_page_html(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) throw UserError(run_dir.string() + " is not a folder; give the output folder of a `loom run`");
  if (!fs::exists(run_dir / "run.json", ec))
    throw UserError(run_dir.string() + " holds no run (no run.json); give the output folder of a `loom run`");
  const Json manifest = read_manifest(run_dir / "run.json");
  const Metrics metrics = read_metrics(run_dir / "metrics.jsonl");
  const std::string name = fs::absolute(run_dir).lexically_normal().filename().string();

  // Every "<" as \u003c (the same JSON string): neither "</script" nor "<!--" (after which, by the
  // HTML spec, the data block would run on through the page's own script) can appear in it.
  std::string data;
  for (const char c : dump(Json{{"series", series_json(metrics)}}))
    if (c == '<')
      data += "\\u003c";
    else
      data += c;

  std::string html = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>loom run " + escape(name) + "</title><style>" +
                     kStyle + "</style></head><body>\n";
  html += "<header><h1>loom run " + escape(name) + "</h1><div class=\"sub\"><code>" + escape(fs::absolute(run_dir).lexically_normal().string()) +
          "</code>, created " + html_of(at_path(manifest, {"created"})) + "</div></header>\n";
  html += summary_section(manifest, metrics) + "\n";
  html += "<section id=\"curves\"><h2>Curves</h2><noscript>The curves are drawn by the page's script; allow JavaScript to see them.</noscript>"
          "<div id=\"charts\"></div></section>\n";
  html += plan_section(manifest, metrics) + "\n" + outputs_section(run_dir) + "\n" + manifest_section(manifest) + "\n";
  html += "<script type=\"application/json\" id=\"loom-data\">" + data + "</script>\n<script>" + kScript + "</script>\n</body></html>\n";
  return html;
}

fs::path write_run_page(const fs::path& run_dir, fs::path output) {
  if (output.empty()) output = run_dir / "report.html";
  kit::write_file_atomically(output, run_page_html(run_dir));
  return output;
}

}  // namespace loom::core
