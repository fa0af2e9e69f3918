// SPDX-License-Identifier: Apache-2.0
// tools/dml-plot.cpp — dml-plot: draws the training curves of one or more CSV logs (the examples' --log: a header
// line, then a row a step) as one SVG file: a panel per column, stacked over one shared step axis, each run in one
// colour in every panel and named in a legend, so two layouts or two learning rates compare in one command. The SVG
// is written as text; no plotting library. The picture is --width wide, and --height tall a panel below a legend
// strip (14 px, and 20 a row of entries).
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "dml/core/error.hpp"
#include "dml/train/flags.hpp"

namespace {

using dml::fail;

// A log as read: its header's names, its rows' cells (a short row padded with empty cells) and their line numbers.
struct table {
  std::string file;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::vector<int> lines;

  int column(std::string_view name) const {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  }
};

std::string join(const std::vector<std::string>& words, const char* between = ",") {
  std::string out;
  for (const auto& w : words) {
    if (!out.empty()) out += between;
    out += w;
  }
  return out;
}

std::vector<std::string> split(std::string_view line) {
  std::vector<std::string> cells;
  for (std::size_t pos = 0;;) {
    const std::size_t comma = std::min(line.find(',', pos), line.size());
    std::string_view cell = line.substr(pos, comma - pos);
    while (!cell.empty() && std::strchr(" \t\r", cell.front())) cell.remove_prefix(1);
    while (!cell.empty() && std::strchr(" \t\r", cell.back())) cell.remove_suffix(1);
    cells.emplace_back(cell);
    if (comma == line.size()) return cells;
    pos = comma + 1;
  }
}

table read_log(const std::string& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) fail<dml::io_error>(file, ": expected a CSV log, found no such file");
  if (std::filesystem::is_directory(file, ec)) fail<dml::io_error>(file, ": expected a CSV log, found a directory");
  std::ifstream in(file);
  if (!in) fail<dml::io_error>(file, ": expected a readable CSV log, found ", std::strerror(errno));
  table t;
  t.file = file;
  std::string line;
  if (!std::getline(in, line))
    fail<dml::format_error>(file, ": expected a header line (step,...), found an empty file");
  t.header = split(line);
  if (t.column("step") < 0)
    fail<dml::format_error>(file, ":1: expected a 'step' column in the header, found ", join(t.header));
  for (int n = 2; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto cells = split(line);
    if (cells.size() > t.header.size())
      fail<dml::format_error>(file, ":", n, ": expected at most ", t.header.size(), " cells (the header's), found ",
                              cells.size());
    cells.resize(t.header.size());  // a row cut short (a run still writing) has empty cells
    t.rows.push_back(std::move(cells));
    t.lines.push_back(n);
  }
  return t;
}

// Row r's cell of column c as a number: none for an empty cell (a value logged on some steps only) or for nan and
// inf (a diverged run); anything else that is not a number is an error naming the file, line and column.
std::optional<double> number(const table& t, std::size_t r, int c) {
  const std::string& s = t.rows[r][c];
  if (s.empty()) return std::nullopt;
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec == std::errc::invalid_argument || end != s.data() + s.size())
    fail<dml::format_error>(t.file, ":", t.lines[r], ": column '", t.header[c], "': expected a number, found '", s,
                            "'");
  if (ec != std::errc{} || !std::isfinite(v)) return std::nullopt;
  return v;
}

struct series {
  std::vector<double> x, y;
};

// One column of one log as (step, value) points, in the log's order.
series points(const table& t, const std::string& name, bool log_y) {
  series s;
  const int c = t.column(name), step = t.column("step");
  if (c < 0) return s;
  for (std::size_t r = 0; r < t.rows.size(); ++r) {
    const auto x = number(t, r, step);
    if (!x)
      fail<dml::format_error>(t.file, ":", t.lines[r], ": column 'step': expected a number, found '", t.rows[r][step],
                              "'");
    const auto y = number(t, r, c);
    if (!y || (log_y && *y <= 0)) continue;
    s.x.push_back(*x);
    s.y.push_back(*y);
  }
  return s;
}

// An axis: the range drawn, and ticks at 1, 2 or 5 × 10^k, the range running from the tick at or below the
// smallest value to the one at or above the largest.
struct axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<double> ticks;
  bool exponent_labels = false;
  int decimals = 0;

  // Where v falls from lo (0) to hi (1).
  double at(double v) const { return log ? std::log10(v / lo) / std::log10(hi / lo) : (v - lo) / (hi - lo); }

  std::string label(double v) const {
    char s[32];
    if (v == 0) return "0";
    if (exponent_labels || log) std::snprintf(s, sizeof s, "%g", v);
    else std::snprintf(s, sizeof s, "%.*f", decimals, v);
    return s;
  }
};

axis linear_axis(double lo, double hi, int want) {
  if (!(lo < hi)) {  // one value: a range around it
    const double pad = lo == 0 ? 1 : std::abs(lo) / 2;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / want, p = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * p;
  for (const double m : {1.0, 2.0, 5.0})
    if (m * p >= raw * (1 - 1e-9)) {
      step = m * p;
      break;
    }
  axis a;
  a.lo = std::floor(lo / step + 1e-9) * step;
  a.hi = std::ceil(hi / step - 1e-9) * step;
  const long n = std::lround((a.hi - a.lo) / step);
  for (long i = 0; i <= n; ++i) {
    const double v = a.lo + static_cast<double>(i) * step;
    a.ticks.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);
  }
  const double big = std::max(std::abs(a.lo), std::abs(a.hi));
  a.exponent_labels = big >= 1e6 || big < 1e-3;
  a.decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  return a;
}

// From the power of 10 at or below the smallest value to the one at or above the largest; ticks at 1, 2 and 5 of
// each decade, or at the powers alone past three decades.
axis log_axis(double lo, double hi) {
  axis a;
  a.log = true;
  a.lo = std::pow(10.0, std::floor(std::log10(lo) + 1e-9));
  a.hi = std::pow(10.0, std::ceil(std::log10(hi) - 1e-9));
  if (a.hi <= a.lo) a.hi = a.lo * 10;
  const bool powers_only = a.hi / a.lo > 1e3 * (1 + 1e-9);
  for (double p = a.lo; p <= a.hi * (1 + 1e-9); p *= 10)
    for (const double m : {1.0, 2.0, 5.0})
      if ((m == 1 || !powers_only) && m * p <= a.hi * (1 + 1e-9)) a.ticks.push_back(m * p);
  return a;
}

std::string xml(std::string_view s) {
  std::string out;
  for (const char c : s) switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  return out;
}

std::string num(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", v);
  return s;
}

// Eight colours told apart on screen and in print (Tableau's ten, less its grey and olive); a ninth run takes the
// first colour again, dashed.
constexpr const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                   "#9467bd", "#8c564b", "#e377c2", "#17becf"};
constexpr int palette_size = sizeof palette / sizeof *palette;

std::string stroke(std::size_t run) {
  std::string s = std::string("stroke=\"") + palette[run % palette_size] + "\"";
  if (run >= palette_size) s += " stroke-dasharray=\"6,3\"";
  return s;
}

// The runs' names in the legend: each file's name, or, where two share one (runs/tp2/log.csv, runs/pp2/log.csv),
// their paths past the folders all of them share (tp2/log.csv, pp2/log.csv).
std::vector<std::string> names(const std::vector<std::string>& files) {
  std::vector<std::vector<std::string>> parts;
  for (const auto& file : files) {
    parts.emplace_back();
    for (const auto& part : std::filesystem::path(file)) parts.back().push_back(part.string());
  }
  std::vector<std::string> out;
  for (const auto& p : parts) out.push_back(p.back());
  const auto shared = [&](const std::string& name) { return std::count(out.begin(), out.end(), name) > 1; };
  if (std::none_of(out.begin(), out.end(), shared)) return out;
  std::size_t common = 0;  // leading folders every path has
  const auto same = [&](std::size_t i) {
    const auto has = [&](const auto& p) { return i + 1 < p.size() && p[i] == parts[0][i]; };
    return std::all_of(parts.begin(), parts.end(), has);
  };
  while (same(common)) ++common;
  for (std::size_t r = 0; r < parts.size(); ++r)
    out[r] = join(std::vector(parts[r].begin() + static_cast<std::ptrdiff_t>(common), parts[r].end()), "/");
  return out;
}

struct figure {
  int width = 800, panel_height = 260;
  bool log_y = false;
  std::vector<std::string> labels, columns;
  std::vector<std::vector<series>> data;  // [column][run]
};

std::string svg(const figure& f) {
  constexpr int left = 72, right = 24, top = 30, bottom = 40;  // a panel's margins around its axes
  // The legend: a line of the run's colour and its name, entries flowing into rows (7 px a character).
  std::string legend;
  int x = left, row = 0;
  for (std::size_t r = 0; r < f.labels.size(); ++r) {
    const int advance = 28 + 7 * static_cast<int>(f.labels[r].size()) + 18;
    if (x > left && x + advance > f.width - right) x = left, ++row;
    const int y = 24 + 20 * row;
    legend += "<line x1=\"" + num(x) + "\" y1=\"" + num(y - 4) + "\" x2=\"" + num(x + 22) + "\" y2=\"" +
              num(y - 4) + "\" " + stroke(r) + " stroke-width=\"3\"/><text x=\"" + num(x + 28) + "\" y=\"" + num(y) +
              "\">" + xml(f.labels[r]) + "</text>\n";
    x += advance;
  }
  const int legend_height = 20 * (row + 1) + 14;
  const int height = legend_height + f.panel_height * static_cast<int>(f.columns.size());
  const std::string w = std::to_string(f.width), h = std::to_string(height);
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                    w + "\" height=\"" + h + "\" viewBox=\"0 0 " + w + " " + h +
                    "\" font-family=\"sans-serif\" font-size=\"12\">\n"
                    "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<g class=\"legend\">\n" +
                    legend + "</g>\n";

  // The step axis is every panel's: from the smallest step plotted to the largest.
  double x_lo = INFINITY, x_hi = -INFINITY;
  for (const auto& runs : f.data)
    for (const auto& s : runs)
      for (const double v : s.x) x_lo = std::min(x_lo, v), x_hi = std::max(x_hi, v);
  if (x_lo > x_hi) x_lo = 0, x_hi = 1;
  const double plot_w = f.width - left - right, plot_h = f.panel_height - top - bottom;
  const axis xa = linear_axis(x_lo, x_hi, std::max(2, static_cast<int>(plot_w / 90)));

  for (std::size_t c = 0; c < f.columns.size(); ++c) {
    const double y0 = legend_height + static_cast<double>(c) * f.panel_height, x1 = left, y1 = y0 + top,
                 x2 = x1 + plot_w, y2 = y1 + plot_h;
    double lo = INFINITY, hi = -INFINITY;
    for (const auto& s : f.data[c])
      for (const double v : s.y) lo = std::min(lo, v), hi = std::max(hi, v);
    const bool empty = lo > hi;
    if (empty) lo = f.log_y ? 1 : 0, hi = f.log_y ? 10 : 1;
    const axis ya = f.log_y ? log_axis(lo, hi) : linear_axis(lo, hi, std::max(2, static_cast<int>(plot_h / 35)));
    const auto px = [&](double v) { return x1 + xa.at(v) * plot_w; };
    const auto py = [&](double v) { return y2 - ya.at(v) * plot_h; };

    out += "<g class=\"panel\" data-column=\"" + xml(f.columns[c]) + "\">\n<text x=\"" + num(x1) + "\" y=\"" +
           num(y0 + 20) + "\" font-size=\"13\" font-weight=\"bold\">" + xml(f.columns[c]) +
           (f.log_y ? " (log scale)" : "") + (empty ? " (no values)" : "") + "</text>\n";
    out += "<g stroke=\"#e6e6e6\">\n";
    const auto line = [](double ax, double ay, double bx, double by) {
      return "<line x1=\"" + num(ax) + "\" y1=\"" + num(ay) + "\" x2=\"" + num(bx) + "\" y2=\"" + num(by) + "\"";
    };
    for (const double t : xa.ticks) out += line(px(t), y1, px(t), y2) + "/>\n";
    for (const double t : ya.ticks) out += line(x1, py(t), x2, py(t)) + "/>\n";
    out += "</g>\n<rect class=\"axes\" x=\"" + num(x1) + "\" y=\"" + num(y1) + "\" width=\"" + num(plot_w) +
           "\" height=\"" + num(plot_h) + "\" fill=\"none\" stroke=\"#444\"/>\n<g fill=\"#333\">\n";
    for (const double t : xa.ticks)
      out += line(px(t), y2, px(t), y2 + 4) + " stroke=\"#444\"/><text x=\"" + num(px(t)) + "\" y=\"" + num(y2 + 17) +
             "\" text-anchor=\"middle\">" + xml(xa.label(t)) + "</text>\n";
    for (const double t : ya.ticks)
      out += line(x1 - 4, py(t), x1, py(t)) + " stroke=\"#444\"/><text x=\"" + num(x1 - 7) + "\" y=\"" +
             num(py(t) + 4) + "\" text-anchor=\"end\">" + xml(ya.label(t)) + "</text>\n";
    if (c + 1 == f.columns.size())
      out += "<text x=\"" + num(x2) + "\" y=\"" + num(y2 + 33) + "\" text-anchor=\"end\">step</text>\n";
    out += "</g>\n";
    for (std::size_t r = 0; r < f.data[c].size(); ++r) {
      const series& s = f.data[c][r];
      if (s.x.empty()) continue;
      std::string pts;
      for (std::size_t i = 0; i < s.x.size(); ++i) {
        if (i) pts += ' ';
        pts += num(px(s.x[i])) + "," + num(py(s.y[i]));
      }
      out += "<polyline class=\"run\" data-run=\"" + std::to_string(r) + "\" fill=\"none\" " + stroke(r) +
             " stroke-width=\"2\" stroke-linejoin=\"round\" points=\"" + pts + "\"/>\n";
      if (s.x.size() == 1)  // a line of one point draws nothing
        out += "<circle cx=\"" + num(px(s.x[0])) + "\" cy=\"" + num(py(s.y[0])) + "\" r=\"3\" fill=\"" +
               palette[r % palette_size] + "\"/>\n";
    }
    out += "</g>\n";
  }
  return out + "</svg>\n";
}

}  // namespace

int main(int argc, char** argv) {
  // dml::flags binds each flag to one variable and takes a fixed number of positional arguments; dml-plot takes any
  // number of logs. The words that are neither a flag nor a flag's value are the logs, and -o is --output; the rest
  // goes to the table.
  std::vector<std::string> logs;
  std::vector<const char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string_view w = argv[i];
    if (w.size() < 2 || w[0] != '-' || (w[1] >= '0' && w[1] <= '9') || w[1] == '.') {
      logs.emplace_back(w);
      continue;
    }
    rest.push_back(w == "-o" ? "--output" : argv[i]);
    const bool switch_word = w == "--log-y" || w == "--help" || w == "-h";
    if (!switch_word && w.find('=') == std::string_view::npos && i + 1 < argc) rest.push_back(argv[++i]);
  }

  std::string output, label;
  std::vector<std::string> columns, labels;
  int width = 800, panel_height = 260;
  bool log_y = false;
  dml::flags cli("dml-plot",
                 "dml-plot RUN.csv [RUN2.csv ...] -o FILE.svg: draws the training curves of CSV logs (the examples' "
                 "--log) as one SVG, a panel per column over a shared step axis, each run one colour.");
  cli.add("--output", output, "FILE", "the SVG to write (-o FILE); default: standard output");
  cli.add("--columns", columns, "A,B,...",
          "the columns to plot, a panel each (default: those of loss, val_loss, tokens_per_s and lr that the logs "
          "hold)");
  // Each --label given, in order: a flag given twice keeps its last value, but its check sees every one.
  cli.add("--label", label, "NAME",
          "a run's name in the legend, once per log in the logs' order (default: the file name)")
      .check([&](const std::string& name) {
        labels.push_back(name);
        return std::string{};
      });
  cli.add("--width", width, "W", "the figure's width in pixels").min(240);
  cli.add("--height", panel_height, "H", "each panel's height in pixels").min(120);
  cli.add_switch("--log-y", log_y, "logarithmic value axes (values <= 0 left out)");
  if (const auto status = cli.parse_for_main(static_cast<int>(rest.size()), rest.data(), [&] {
        if (logs.empty())
          dml::fail<dml::invalid_argument>(
              "expected one or more CSV logs (dml-plot RUN.csv ... -o FILE.svg), found none");
        if (!labels.empty() && labels.size() != logs.size())
          dml::fail<dml::invalid_argument>("--label: expected one per log (", logs.size(), "), found ", labels.size());
      }))
    return *status;

  try {
    std::vector<table> tables;
    for (const auto& file : logs) tables.push_back(read_log(file));
    std::vector<std::string> known;  // every log's columns, in the order they first appear
    for (const auto& t : tables)
      for (const auto& h : t.header)
        if (std::find(known.begin(), known.end(), h) == known.end()) known.push_back(h);

    figure f;
    f.width = width, f.panel_height = panel_height, f.log_y = log_y;
    const auto add = [&](const std::string& name) {
      std::vector<series> runs;
      for (const auto& t : tables) runs.push_back(points(t, name, log_y));
      f.columns.push_back(name);
      f.data.push_back(std::move(runs));
    };
    if (columns.empty()) {
      for (const char* name : {"loss", "val_loss", "tokens_per_s", "lr"}) {
        add(name);
        const auto& runs = f.data.back();
        if (std::all_of(runs.begin(), runs.end(), [](const series& s) { return s.x.empty(); }))
          f.columns.pop_back(), f.data.pop_back();
      }
      if (f.columns.empty())
        dml::fail<dml::invalid_argument>("expected a value in a column loss, val_loss, tokens_per_s or lr, found "
                                         "none in the columns ", join(known), " (--columns picks others)");
    } else {
      for (const auto& name : columns) {
        if (std::find(known.begin(), known.end(), name) == known.end())
          dml::fail<dml::invalid_argument>("--columns: expected a column of the logs (", join(known), "), found '",
                                           name, "'");
        add(name);
      }
    }

    f.labels = labels.empty() ? names(logs) : labels;

    const std::string text = svg(f);
    if (output.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      return 0;
    }
    std::ofstream out(output);
    out << text;
    out.close();
    if (!out) dml::fail<dml::io_error>(output, ": expected a writable file, found ", std::strerror(errno));
    std::printf("dml-plot: wrote %s: %zu run%s, %zu panel%s (%s)\n", output.c_str(), logs.size(),
                logs.size() == 1 ? "" : "s", f.columns.size(), f.columns.size() == 1 ? "" : "s",
                join(f.columns, ", ").c_str());
    return 0;
  } catch (const dml::error& e) {
    std::fprintf(stderr, "dml-plot: error: %s\n", e.what());
    return 2;
  }
}
