//! The SVG plot: the latency-throughput curve (one line per config of a sweep),
//! latency percentiles against the load, and the executed batch sizes of the point with
//! the highest throughput.

use crate::report::Point;
use plotters::prelude::*;
use std::path::Path;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn err(e: impl std::fmt::Display) -> String {
    format!("drawing the plot: {e}")
}

/// Draws `series` (label, points); the percentile and histogram panels show `focus`.
pub fn draw(
    path: &Path,
    title: &str,
    series: &[(String, Vec<Point>)],
    focus: usize,
) -> Result<(), String> {
    let all: Vec<&Point> = series.iter().flat_map(|(_, p)| p.iter()).collect();
    if all.is_empty() {
        return Err("drawing the plot: nothing was measured".into());
    }
    let root = SVGBackend::new(path, (1500, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    let panels = root.split_evenly((1, 3));
    let ms = |us: f64| us / 1e3;

    // 1. Latency (p50 and p99) against throughput.
    let max_t = all
        .iter()
        .map(|p| p.inferences_per_s)
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.05;
    let max_l = all
        .iter()
        .map(|p| ms(p.p99_us))
        .fold(0.0, f64::max)
        .max(0.001)
        * 1.5; // head room above the points for the legend
    let mut c = ChartBuilder::on(&panels[0])
        .caption("Latency vs throughput", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max_t, 0.0..max_l)
        .map_err(err)?;
    c.configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc("inferences/s")
        .y_desc("latency (ms)")
        .draw()
        .map_err(err)?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let p99: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.inferences_per_s, ms(p.p99_us)))
            .collect();
        let p50: Vec<(f64, f64)> = pts
            .iter()
            .map(|p| (p.inferences_per_s, ms(p.p50_us)))
            .collect();
        let name = if label.is_empty() {
            String::new()
        } else {
            format!("{label} ")
        };
        c.draw_series(LineSeries::new(p99.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name}p99"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        c.draw_series(
            p99.iter()
                .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
        )
        .map_err(err)?;
        c.draw_series(LineSeries::new(p50, color.stroke_width(1)))
            .map_err(err)?
            .label(format!("{name}p50"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(1))
            });
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;

    // 2. Percentiles against the load, for the focused series.
    let (label, pts) = &series[focus.min(series.len() - 1)];
    let rate = pts.first().is_some_and(|p| p.rate_mode);
    let max_x = pts.iter().map(|p| p.load).fold(0.0, f64::max).max(1.0);
    let max_y = pts
        .iter()
        .map(|p| ms(p.p99_us))
        .fold(0.0, f64::max)
        .max(0.001)
        * 1.5;
    let mut c = ChartBuilder::on(&panels[1])
        .caption(
            if label.is_empty() {
                "Latency percentiles".to_owned()
            } else {
                format!("Latency percentiles ({label})")
            },
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max_x * 1.05, 0.0..max_y)
        .map_err(err)?;
    c.configure_mesh()
        .light_line_style(WHITE)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .x_desc(if rate {
            "requests/s sent"
        } else {
            "concurrency"
        })
        .y_desc("latency (ms)")
        .draw()
        .map_err(err)?;
    type Pick = fn(&Point) -> f64;
    let lines: [(&str, Pick); 4] = [
        ("p50", |p| p.p50_us),
        ("p90", |p| p.p90_us),
        ("p95", |p| p.p95_us),
        ("p99", |p| p.p99_us),
    ];
    for (i, (name, pick)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let v: Vec<(f64, f64)> = pts.iter().map(|p| (p.load, ms(pick(p)))).collect();
        c.draw_series(LineSeries::new(v.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        c.draw_series(
            v.iter()
                .map(|&(x, y)| Circle::new((x, y), 3, color.filled())),
        )
        .map_err(err)?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;

    // 3. Executed batch sizes at the point of highest throughput.
    let best = pts
        .iter()
        .max_by(|a, b| a.inferences_per_s.total_cmp(&b.inferences_per_s))
        .cloned()
        .unwrap_or_default();
    let hist = &best.server.batch_sizes;
    let max_size = hist.keys().copied().max().unwrap_or(1).max(1);
    let max_count = hist.values().copied().max().unwrap_or(1).max(1);
    let mut c = ChartBuilder::on(&panels[2])
        .caption(
            format!(
                "Batch sizes at {} {}",
                best.load,
                if rate { "requests/s" } else { "in flight" }
            ),
            ("sans-serif", 16),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(
            (1u64..max_size + 1).into_segmented(),
            0u64..(max_count + max_count / 10 + 1),
        )
        .map_err(err)?;
    c.configure_mesh()
        .light_line_style(WHITE)
        .disable_x_mesh()
        .x_desc("executed batch size")
        .y_desc("executions")
        .draw()
        .map_err(err)?;
    c.draw_series(
        Histogram::vertical(&c)
            .style(COLORS[0].filled())
            .margin(2)
            .data(hist.iter().map(|(s, n)| (*s, *n))),
    )
    .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
