// Writes the benchmark's plot: time per step against K, one panel per mode, as SVG.
#pragma once

#include <string>
#include <vector>

namespace blockswap::tool {

struct PlotSeries {
  std::string name;
  std::string color;
  std::vector<double> x, y;
  bool dashed = false;
};

struct PlotPanel {
  std::string title;
  std::vector<PlotSeries> series;
};

// Throws blockswap::Error when the file cannot be written.
void write_svg_plot(const std::string& path, const std::string& title, const std::string& x_label,
                    const std::string& y_label, const std::vector<PlotPanel>& panels);

} // namespace blockswap::tool
