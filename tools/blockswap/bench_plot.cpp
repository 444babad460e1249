#include "bench_plot.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "blockswap/core/error.hpp"

namespace blockswap::tool {
namespace {

constexpr double kPanelWidth = 460, kPanelHeight = 320, kMargin = 60, kTop = 50;

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else
      out += c;
  }
  return out;
}

// A round step for about five ticks up to `max`.
double tick_step(double max) {
  const double raw = max / 5;
  const double power = std::pow(10, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) return m * power;
  }
  return 10 * power;
}

void panel(std::ostream& svg, const PlotPanel& p, double left, const std::string& x_label,
           const std::string& y_label) {
  double x_max = 1, y_max = 0;
  for (const auto& s : p.series) {
    for (double x : s.x) x_max = std::max(x_max, x);
    for (double y : s.y) y_max = std::max(y_max, y);
  }
  const double y_step = tick_step(y_max > 0 ? y_max : 1);
  y_max = std::ceil(y_max / y_step) * y_step;
  if (y_max <= 0) y_max = y_step;
  const double w = kPanelWidth - kMargin - 20, h = kPanelHeight - 2 * 40;
  const double x0 = left + kMargin, y0 = kTop + 30 + h;
  auto px = [&](double x) { return x0 + x / x_max * w; };
  auto py = [&](double y) { return y0 - y / y_max * h; };
  svg << "<text x='" << x0 + w / 2 << "' y='" << kTop + 15
      << "' text-anchor='middle' font-weight='bold'>" << escape(p.title) << "</text>\n";
  svg << "<rect x='" << x0 << "' y='" << y0 - h << "' width='" << w << "' height='" << h
      << "' fill='none' stroke='#888'/>\n";
  for (double y = 0; y <= y_max + 1e-12; y += y_step) {
    svg << "<line x1='" << x0 << "' x2='" << x0 + w << "' y1='" << py(y) << "' y2='" << py(y)
        << "' stroke='#eee'/><text x='" << x0 - 6 << "' y='" << py(y) + 4
        << "' text-anchor='end' font-size='11'>" << y << "</text>\n";
  }
  const double x_step = std::max(1.0, std::round(x_max / 8));
  for (double x = 0; x <= x_max + 1e-9; x += x_step) {
    svg << "<text x='" << px(x) << "' y='" << y0 + 16 << "' text-anchor='middle' font-size='11'>"
        << x << "</text>\n";
  }
  svg << "<text x='" << x0 + w / 2 << "' y='" << y0 + 34 << "' text-anchor='middle' font-size='12'>"
      << escape(x_label) << "</text>\n";
  svg << "<text transform='translate(" << left + 16 << "," << y0 - h / 2
      << ") rotate(-90)' text-anchor='middle' font-size='12'>" << escape(y_label) << "</text>\n";
  double legend_y = y0 - h + 14;
  for (const auto& s : p.series) {
    svg << "<polyline fill='none' stroke='" << s.color << "' stroke-width='2'"
        << (s.dashed ? " stroke-dasharray='6,4'" : "") << " points='";
    for (std::size_t i = 0; i < s.x.size(); ++i) svg << px(s.x[i]) << "," << py(s.y[i]) << " ";
    svg << "'/>\n";
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      svg << "<circle cx='" << px(s.x[i]) << "' cy='" << py(s.y[i]) << "' r='2.5' fill='" << s.color
          << "'/>\n";
    }
    svg << "<line x1='" << x0 + 10 << "' x2='" << x0 + 34 << "' y1='" << legend_y << "' y2='"
        << legend_y << "' stroke='" << s.color << "' stroke-width='2'"
        << (s.dashed ? " stroke-dasharray='6,4'" : "") << "/><text x='" << x0 + 40 << "' y='"
        << legend_y + 4 << "' font-size='11'>" << escape(s.name) << "</text>\n";
    legend_y += 16;
  }
}

} // namespace

void write_svg_plot(const std::string& path, const std::string& title, const std::string& x_label,
                    const std::string& y_label, const std::vector<PlotPanel>& panels) {
  std::ostringstream svg;
  const double width = kPanelWidth * static_cast<double>(panels.size());
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='"
      << kPanelHeight + kTop << "' font-family='sans-serif'>\n<rect width='100%' height='100%' "
      << "fill='white'/>\n<text x='" << width / 2 << "' y='24' text-anchor='middle' font-size='15'>"
      << escape(title) << "</text>\n";
  for (std::size_t i = 0; i < panels.size(); ++i) {
    panel(svg, panels[i], kPanelWidth * static_cast<double>(i), x_label, y_label);
  }
  svg << "</svg>\n";
  std::ofstream file(path, std::ios::trunc);
  BLOCKSWAP_CHECK(file.is_open(), "cannot write the plot to '", path, "'");
  file << svg.str();
  BLOCKSWAP_CHECK(file.good(), "error while writing the plot to '", path, "'");
}

} // namespace blockswap::tool
