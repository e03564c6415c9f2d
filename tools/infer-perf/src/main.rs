//! infer-perf: measures a model of a repository served by libinfer in-process, as
//! perf_analyzer, genai-perf and model_analyzer measure a Triton server.

mod capi;
mod inputs;
mod load;
mod plot;
mod report;
mod stats;
mod sweep;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use inputs::{DataSet, Fill, ModelInfo, Source};
use load::{Load, Settings};
use report::Point;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};

use std::path::{Path, PathBuf};
use std::sync::Arc;

const EXAMPLES: &str = "\
Examples:
  # Latency and throughput of models/add_sub at 1 to 8 requests in flight, with a plot:
  infer-perf --model-repository models -m add_sub --concurrency-range 1:8:1 --plot add_sub.svg

  # Poisson arrivals at 100, 200 and 300 requests/s, written as perf_analyzer's CSV:
  infer-perf -m mlp --request-rate-range 100:300:100 --request-distribution poisson -f mlp.csv

  # A variable-size input, batch 4, random values:
  infer-perf -m cnn --shape input:3,32,32 -b 4 --input-data random

  # Time to first token, inter-token latency and tokens/s of a generative model:
  infer-perf -m tiny_gpt2 --shape input_ids:16 --output-tokens 32 --concurrency-range 1:8:7

  # Which dynamic batching config serves most under a 10 ms p99 budget:
  infer-perf -m add_sub --concurrency-range 4:16:4 --sweep max_batch_size=4,16 \\
      --sweep max_queue_delay_microseconds=0,500 --latency-budget-ms 10

The load points are measured in windows of --measurement-interval; a point ends when three
windows in a row agree within --stability-percentage (throughput and latency), and the
first window of every point (warm-up) is not counted.";

/// Measures a model served by libinfer in-process: latency and throughput at each load
/// point, the server's own time split, tables, perf_analyzer's CSV and SVG plots.
#[derive(Parser, Debug)]
#[command(name = "infer-perf", version, after_help = EXAMPLES)]
struct Args {
    /// The model to measure (a folder of the repository).
    #[arg(short = 'm', long = "model-name")]
    model: String,
    /// The model repository.
    #[arg(long, default_value = "models")]
    model_repository: PathBuf,
    /// Closed loop: START[:END[:STEP]] requests in flight (the default: 1).
    #[arg(long, value_name = "START:END:STEP")]
    concurrency_range: Option<String>,
    /// Open loop: START[:END[:STEP]] requests per second.
    #[arg(
        long,
        value_name = "START:END:STEP",
        conflicts_with = "concurrency_range"
    )]
    request_rate_range: Option<String>,
    /// Arrivals of --request-rate-range: constant gaps or poisson.
    #[arg(long, default_value = "constant", value_parser = ["constant", "poisson"])]
    request_distribution: String,
    /// The length of a measurement window, in milliseconds.
    #[arg(short = 'p', long, default_value_t = 2000)]
    measurement_interval: u64,
    /// Windows agree when each is within this percent of their average.
    #[arg(short = 's', long, default_value_t = 10.0)]
    stability_percentage: f64,
    /// Windows measured per point at most (then the last three are reported).
    #[arg(long, default_value_t = 10)]
    max_trials: usize,
    /// The latency percentile that the stability rule and --latency-budget-ms use (by
    /// default: the average for stability, p99 for the budget).
    #[arg(long, value_parser = ["50", "90", "95", "99"])]
    percentile: Option<String>,
    /// Input values: zero, random, a JSON file in perf_analyzer's layout, or a folder
    /// with one raw file per input, named as the input.
    #[arg(long, default_value = "random")]
    input_data: String,
    /// The dims of an input with variable dims (repeatable), without the batch dim.
    #[arg(long, value_name = "NAME:D1,D2,...")]
    shape: Vec<String>,
    /// Rows per request (models that batch).
    #[arg(short = 'b', long, default_value_t = 1)]
    batch_size: i64,
    /// Bytes of each generated string of a BYTES input.
    #[arg(long, default_value_t = 16)]
    string_length: usize,
    /// Requests per sequence (sequence models, generated data).
    #[arg(long, default_value_t = 20)]
    sequence_length: usize,
    /// Sequences open at once in request-rate mode (sequence models).
    #[arg(long = "num-of-sequences", default_value_t = 4)]
    num_sequences: usize,
    /// Generative models: tokens to generate per request (streamed; end tokens ignored).
    #[arg(long, default_value_t = 16)]
    output_tokens: i64,
    /// Writes every point as CSV, perf_analyzer's column names first.
    #[arg(short = 'f', long = "csv", value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Draws the latency-throughput curve, the percentiles and the batch sizes (SVG).
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Tries config overrides, reloading the model for each combination (repeatable):
    /// max_batch_size, max_queue_delay_microseconds, preferred_batch_size (4+8 for
    /// [4, 8]), instance_count.
    #[arg(long, value_name = "KEY=V1,V2,...")]
    sweep: Vec<String>,
    /// With --sweep: the best config is the one with the highest throughput at a point
    /// whose latency (p99, or --percentile) is within this budget.
    #[arg(long, value_name = "MS")]
    latency_budget_ms: Option<f64>,
    /// Stops a range at the first point whose latency (p99, or --percentile) is over
    /// this, as perf_analyzer's --latency-threshold.
    #[arg(short = 'l', long, value_name = "MS")]
    latency_threshold_ms: Option<f64>,
    /// With --sweep: writes the best config (JSON, which `infer_server_load_model` takes
    /// as it takes config.pbtxt text) to FILE.
    #[arg(long, value_name = "FILE")]
    export_config: Option<PathBuf>,
    /// GPU use of the server: auto (one when present), off, or required.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off", "required"])]
    gpu: String,
    /// The ONNX Runtime library for ONNX models (else INFER_ONNXRUNTIME_LIBRARY, the
    /// program's folder and the loader's paths).
    #[arg(long, value_name = "PATH")]
    onnxruntime_library: Option<PathBuf>,
    /// The library's log lines shown on stderr: error, warn, info (which engine runs the
    /// model, its instances) or debug.
    #[arg(long, default_value = "warn", value_parser = ["error", "warn", "info", "debug"])]
    log_level: String,
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("infer-perf: error: {e}");
            std::process::exit(1);
        }
    }
}

/// `START[:END[:STEP]]` as the list of points.
/// `START[:END[:STEP]]` as the list of points, each within `lo..=hi`.
fn parse_range(s: &str, what: &str, lo: f64, hi: f64) -> Result<Vec<f64>, String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.is_empty() || parts.len() > 3 {
        return Err(format!("{what} '{s}': expected START[:END[:STEP]]"));
    }
    let num = |x: &str| {
        x.trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("{what} '{s}': '{x}' is not a number above 0"))
    };
    let start = num(parts[0])?;
    let end = parts.get(1).map(|x| num(x)).transpose()?.unwrap_or(start);
    let step = parts.get(2).map(|x| num(x)).transpose()?.unwrap_or(1.0);
    for v in [start, end] {
        if !(lo..=hi).contains(&v) {
            return Err(format!("{what} '{s}': {v} is outside {lo}..={hi}"));
        }
    }
    if end < start {
        return Err(format!("{what} '{s}': END is below START"));
    }
    let n = ((end - start) / step + 1e-9).floor() as u64 + 1;
    if n > 10_000 {
        return Err(format!("{what} '{s}': more than 10000 points"));
    }
    // Rounded to 1e-9, so that 0.1:0.3:0.1 ends at 0.3.
    Ok((0..n)
        .map(|i| ((start + i as f64 * step) * 1e9).round() / 1e9)
        .collect())
}

fn loads(args: &Args) -> Result<Vec<Load>, String> {
    if let Some(r) = &args.request_rate_range {
        let poisson = args.request_distribution == "poisson";
        return Ok(parse_range(r, "--request-rate-range", 0.01, 1e7)?
            .into_iter()
            .map(|per_s| Load::Rate { per_s, poisson })
            .collect());
    }
    let c = args.concurrency_range.as_deref().unwrap_or("1");
    parse_range(c, "--concurrency-range", 1.0, 100_000.0)?
        .into_iter()
        .map(|v| {
            if v.fract() != 0.0 {
                Err(format!(
                    "--concurrency-range '{c}': {v} is not a whole number"
                ))
            } else {
                Ok(Load::Concurrency(v as usize))
            }
        })
        .collect()
}

/// Shows the run's progress: on a terminal a bar over every load point with the current
/// point's last window; plain lines on stderr otherwise.
struct Display {
    bar: Option<ProgressBar>,
    label: parking_lot::Mutex<String>,
}

impl Display {
    fn new(points: usize) -> Display {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(points as u64);
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} points [{elapsed}] {prefix} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(200));
            b
        });
        Display {
            bar,
            label: parking_lot::Mutex::new(String::new()),
        }
    }

    fn start(&self, label: String) {
        match &self.bar {
            Some(b) => {
                b.set_prefix(label.clone());
                b.set_message("warming up");
            }
            None => eprintln!("{label}: warming up"),
        }
        *self.label.lock() = label;
    }

    fn point_done(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    /// Prints `text` on stdout without tearing the bar.
    fn print(&self, text: &str) {
        let mut out = std::io::stdout();
        match &self.bar {
            Some(b) => b.suspend(|| {
                let _ = write!(out, "{text}");
                let _ = out.flush();
            }),
            None => {
                let _ = write!(out, "{text}");
                let _ = out.flush();
            }
        }
    }
}

impl load::Progress for Display {
    fn window(&self, trial: usize, throughput: f64, latency_us: f64) {
        let msg = format!("window {trial}: {throughput:.1} infer/s, latency {latency_us:.0} usec");
        match &self.bar {
            Some(b) => b.set_message(msg),
            None => eprintln!("{}: {msg}", self.label.lock()),
        }
    }
}

/// Why a model cannot be loaded from the repository, before the server tries.
fn check_repository(repo: &Path, model: &str) -> Result<(), String> {
    if !repo.is_dir() {
        return Err(format!(
            "model repository '{}' is not a folder",
            repo.display()
        ));
    }
    if !repo.join(model).is_dir() {
        let mut names: Vec<String> = std::fs::read_dir(repo)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        return Err(format!(
            "model '{model}' is not in repository '{}' (models there: {})",
            repo.display(),
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        ));
    }
    Ok(())
}

fn data_set(args: &Args, info: &ModelInfo) -> Result<DataSet, String> {
    let mut shapes = BTreeMap::new();
    for s in &args.shape {
        let (n, d) = inputs::parse_shape(s)?;
        shapes.insert(n, d);
    }
    let fill = Fill {
        model: info,
        shapes: &shapes,
        batch_size: args.batch_size,
        string_length: args.string_length,
    };
    let source = match args.input_data.as_str() {
        "zero" => Source::Zero,
        "random" => Source::Random,
        f => Source::File(PathBuf::from(f)),
    };
    match source {
        Source::Zero => fill.synthetic(false, 0),
        Source::Random => fill.synthetic(true, 0x1f2e3d),
        Source::File(p) if p.is_dir() => fill.directory(&p),
        Source::File(p) => {
            let text = std::fs::read_to_string(&p)
                .map_err(|e| format!("--input-data '{}': {e}", p.display()))?;
            fill.json(&text, &p.display().to_string())
        }
    }
}

/// Measures the load points of one config in order; prints each point. With a latency
/// threshold, the points stop after the first one over it.
#[allow(clippy::too_many_arguments)]
fn measure_all(
    server: &Arc<capi::Server>,
    info: &ModelInfo,
    data: &Arc<DataSet>,
    settings: &Settings,
    loads: &[Load],
    label: &str,
    threshold_us: Option<f64>,
    display: &Display,
) -> Result<Vec<Point>, String> {
    let mut points = Vec::new();
    for (i, l) in loads.iter().enumerate() {
        let name = match l {
            Load::Concurrency(n) => format!("concurrency {n}"),
            Load::Rate { per_s, .. } => format!("{per_s} requests/s"),
        };
        let name = if label.is_empty() {
            name
        } else {
            format!("[{label}] {name}")
        };
        display.start(name);
        let m = load::measure(server, info, data, settings, l, display)?;
        display.point_done();
        let p = Point::of(l, m, settings.batch_size, info);
        display.print(&report::point_text(&p));
        let over = threshold_us.is_some_and(|t| p.latency_at(settings.percentile) > t);
        points.push(p);
        if over {
            let left = loads.len() - i - 1;
            if let Some(b) = &display.bar {
                b.inc(left as u64);
            }
            if left > 0 {
                display.print(&format!(
                    "Latency over --latency-threshold: the {left} higher load point(s) are skipped\n"
                ));
            }
            break;
        }
    }
    Ok(points)
}

/// What is measured, printed first (perf_analyzer's "Measurement Settings").
fn settings_text(args: &Args, cfg: &serde_json::Value, loads: &[Load]) -> String {
    let engine = cfg["platform"]
        .as_str()
        .filter(|p| !p.is_empty())
        .or(cfg["backend"].as_str())
        .unwrap_or("?");
    let mut model = format!(
        "  Model: {} ({engine}), max_batch_size {}",
        args.model,
        cfg["max_batch_size"].as_i64().unwrap_or(0)
    );
    if let Some(db) = cfg.get("dynamic_batching").filter(|v| v.is_object()) {
        let delay = &db["max_queue_delay_microseconds"];
        let delay = delay
            .as_u64()
            .or_else(|| delay.as_str().and_then(|s| s.parse().ok()))
            .unwrap_or(0);
        model.push_str(&format!(
            ", dynamic batching (max_queue_delay_microseconds {delay}"
        ));
        if let Some(p) = db["preferred_batch_size"]
            .as_array()
            .filter(|p| !p.is_empty())
        {
            model.push_str(&format!(
                ", preferred_batch_size {}",
                serde_json::Value::from(p.clone())
            ));
        }
        model.push(')');
    }
    if cfg.get("sequence_batching").is_some_and(|v| v.is_object()) {
        model.push_str(", sequence batching");
    }
    if cfg
        .get("ensemble_scheduling")
        .is_some_and(|v| v.is_object())
    {
        model.push_str(", ensemble");
    }
    let groups: Vec<String> = cfg["instance_group"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|g| {
            format!(
                "{} x {}",
                g["count"].as_u64().unwrap_or(1),
                g["kind"].as_str().unwrap_or("KIND_AUTO")
            )
        })
        .collect();
    if !groups.is_empty() {
        model.push_str(&format!(", instances {}", groups.join(" + ")));
    }
    let load = match (loads.first(), loads.last()) {
        (Some(Load::Concurrency(a)), Some(Load::Concurrency(b))) => {
            format!("concurrency {a} to {b} ({} points)", loads.len())
        }
        (Some(Load::Rate { per_s: a, poisson }), Some(Load::Rate { per_s: b, .. })) => format!(
            "{a} to {b} requests/s, {} arrivals ({} points)",
            if *poisson { "Poisson" } else { "constant" },
            loads.len()
        ),
        _ => String::new(),
    };
    format!(
        "*** Measurement Settings ***\n{model}\n  Batch size: {}; input data: {}\n  Load: {load}\n  Windows of {} ms; a point is stable when 3 windows agree within {}%; at most {} windows\n",
        args.batch_size,
        args.input_data,
        args.measurement_interval,
        args.stability_percentage,
        args.max_trials.max(3)
    )
}

fn run(args: &Args) -> Result<i32, String> {
    let loads = loads(args)?;
    let axes = args
        .sweep
        .iter()
        .map(|s| sweep::parse_axis(s))
        .collect::<Result<Vec<_>, _>>()?;
    if args.latency_budget_ms.is_some() && axes.is_empty() {
        return Err("--latency-budget-ms needs --sweep".into());
    }
    if args.export_config.is_some() && axes.is_empty() {
        return Err("--export-config needs --sweep".into());
    }
    if args.batch_size < 1 {
        return Err("--batch-size must be at least 1".into());
    }
    if !(10..=3_600_000).contains(&args.measurement_interval) {
        return Err("--measurement-interval must be 10 ms to 1 hour".into());
    }
    check_repository(&args.model_repository, &args.model)?;
    let server = Arc::new(capi::Server::open(&capi::Options {
        repository: args.model_repository.clone(),
        gpu: match args.gpu.as_str() {
            "off" => capi::GPU_OFF,
            "required" => capi::GPU_REQUIRED,
            _ => capi::GPU_AUTO,
        },
        log_level: match args.log_level.as_str() {
            "error" => 1,
            "info" => 3,
            "debug" => 4,
            _ => 2,
        },
        onnxruntime_library: args.onnxruntime_library.clone(),
    })?);
    server.load(&args.model, None, None)?;
    let base = server.config(&args.model)?;
    let info = ModelInfo::from_config(&args.model, &base)?;
    if info.decoupled && !info.generative {
        return Err(format!(
            "model '{}' is decoupled: only generative decoupled models (gpt2, llama) are measured",
            args.model
        ));
    }
    let data = Arc::new(data_set(args, &info)?);
    println!("{}", settings_text(args, &base, &loads));
    let settings = Settings {
        measurement_ms: args.measurement_interval,
        stability_pct: args.stability_percentage,
        max_trials: args.max_trials.max(3),
        percentile: args.percentile.as_deref().and_then(|p| p.parse().ok()),
        sequence_length: args.sequence_length.max(1),
        num_sequences: args.num_sequences.max(1),
        output_tokens: args.output_tokens,
        batch_size: args.batch_size as u64,
    };
    let rate_mode = args.request_rate_range.is_some();
    let mut csv = String::new();
    let mut series: Vec<(String, Vec<Point>)> = Vec::new();
    // Each combination's config as the library completed it.
    let mut configs: Vec<serde_json::Value> = Vec::new();
    let combos = if axes.is_empty() {
        vec![Vec::new()]
    } else {
        sweep::combinations(&axes)
    };
    let display = Display::new(combos.len() * loads.len());
    for combo in &combos {
        let label = sweep::label(combo);
        let (info, data) = if combo.is_empty() {
            (info.clone(), data.clone())
        } else {
            let cfg = sweep::apply(&base, combo, &args.model)?;
            let text = serde_json::to_string(&cfg).map_err(|e| e.to_string())?;
            display.print(&format!("=== {label}\n"));
            server
                .load(
                    &args.model,
                    Some(&text),
                    Some(&args.model_repository.join(&args.model)),
                )
                .map_err(|e| format!("{label}: {e}"))?;
            let loaded = server.config(&args.model)?;
            let info = ModelInfo::from_config(&args.model, &loaded)?;
            configs.push(loaded);
            // The inputs as this config takes them (a batch dim or not).
            let data = data_set(args, &info).map_err(|e| format!("{label}: {e}"))?;
            let data = Arc::new(data);
            (info, data)
        };
        let points = measure_all(
            &server,
            &info,
            &data,
            &settings,
            &loads,
            &label,
            args.latency_threshold_ms.map(|t| t * 1e3),
            &display,
        )?;
        series.push((label, points));
    }
    display.finish();
    let sweeping = !axes.is_empty();
    csv.push_str(&report::csv_header(rate_mode, info.generative, sweeping));
    csv.push('\n');
    for (label, points) in &series {
        if sweeping {
            println!("\n{label}");
        } else {
            println!();
        }
        print!("{}", report::table(points));
        for p in points {
            csv.push_str(&report::csv_row(p, sweeping.then_some(label.as_str())));
            csv.push('\n');
        }
    }
    let mut focus = 0;
    let mut code = 0;
    if sweeping {
        let pct = settings.percentile;
        let pname = pct.map_or("p99".to_owned(), |p| format!("p{p}"));
        let budget_us = args.latency_budget_ms.map(|b| b * 1e3);
        // (config index, best point within budget)
        let mut best: Vec<(usize, Option<&Point>)> = series
            .iter()
            .enumerate()
            .map(|(i, (_, pts))| {
                let ok = pts
                    .iter()
                    .filter(|p| budget_us.is_none_or(|b| p.latency_at(pct) <= b) && p.errors == 0)
                    .max_by(|a, b| a.inferences_per_s.total_cmp(&b.inferences_per_s));
                (i, ok)
            })
            .collect();
        best.sort_by(|a, b| {
            let t = |x: &Option<&Point>| x.map_or(-1.0, |p| p.inferences_per_s);
            t(&b.1).total_cmp(&t(&a.1))
        });
        println!(
            "\nConfigs by throughput{}:",
            args.latency_budget_ms.map_or(String::new(), |b| format!(
                " with {pname} latency within {b} ms"
            ))
        );
        for (i, p) in &best {
            match p {
                Some(p) => println!(
                    "  {:<60} {:>10.1} infer/s at {} {}, {pname} {:.0} usec",
                    series[*i].0,
                    p.inferences_per_s,
                    if p.rate_mode {
                        "request rate"
                    } else {
                        "concurrency"
                    },
                    p.load,
                    p.latency_at(pct)
                ),
                None => println!("  {:<60} no point within the budget", series[*i].0),
            }
        }
        match best.first() {
            Some((i, Some(p))) => {
                focus = *i;
                println!(
                    "Best config: {} ({:.1} infer/s, {pname} {:.0} usec)",
                    series[*i].0,
                    p.inferences_per_s,
                    p.latency_at(pct)
                );
                if let Some(f) = &args.export_config {
                    let text =
                        serde_json::to_string_pretty(&configs[*i]).map_err(|e| e.to_string())?;
                    std::fs::write(f, text + "\n")
                        .map_err(|e| format!("--export-config '{}': {e}", f.display()))?;
                    println!(
                        "Its config (JSON, as the library completed it): {}",
                        f.display()
                    );
                }
            }
            _ => {
                println!("Best config: none meets the latency budget");
                code = 2;
            }
        }
        // The model is left as the repository has it.
        server.load(&args.model, None, None)?;
    }
    if let Some(f) = &args.csv {
        std::fs::write(f, &csv).map_err(|e| format!("--csv '{}': {e}", f.display()))?;
    }
    if let Some(f) = &args.plot {
        let title = format!("{} (batch size {})", args.model, args.batch_size);
        plot::draw(f, &title, &series, focus)?;
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_range_t(s: &str, what: &str) -> Result<Vec<f64>, String> {
        parse_range(s, what, 0.01, 1e7)
    }

    #[test]
    fn ranges_expand_inclusively() {
        assert_eq!(
            parse_range_t("1:4:1", "r").unwrap(),
            vec![1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(parse_range_t("2", "r").unwrap(), vec![2.0]);
        assert_eq!(parse_range_t("1:8:4", "r").unwrap(), vec![1.0, 5.0]);
        assert_eq!(
            parse_range_t("100:300:100", "r").unwrap(),
            vec![100.0, 200.0, 300.0]
        );
        assert!(parse_range_t("4:1", "r")
            .unwrap_err()
            .contains("END is below START"));
        assert!(parse_range_t("0", "r").unwrap_err().contains("above 0"));
        assert!(parse_range_t("1:2:3:4", "r").is_err());
        assert_eq!(
            parse_range_t("0.1:0.3:0.1", "r").unwrap(),
            vec![0.1, 0.2, 0.3]
        );
        assert!(parse_range_t("1e19", "r").unwrap_err().contains("outside"));
    }
}
