//! SVG charts of measurements: grouped bars (throughput per path and workload, wire/raw per
//! mechanism) and latency percentile curves (the CDF of round trips, its y axis in nines so the
//! tail shows). Pure: figures in, an SVG document out, drawn with plotters' SVG backend.

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Width of every panel, in pixels.
const WIDTH: u32 = 960;
/// Height of one panel.
const PANEL: u32 = 440;
/// The deepest percentile drawn: 99.99% (four nines).
const NINES: f64 = 4.0;

/// Series colours (Tableau 10): distinct on white and for most colour-blind readers.
const COLOURS: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// One bar per series in each group.
#[derive(Debug, Clone)]
pub struct Bars {
    pub title: String,
    /// What a bar's height is, such as "Mbytes/s" or "wire / raw".
    pub unit: String,
    /// Groups along the x axis (workloads, data sets).
    pub groups: Vec<String>,
    /// Series (paths, mechanisms): one value per group, `None` where it was not measured.
    pub series: Vec<(String, Vec<Option<f64>>)>,
    /// Always a linear scale (shares of a whole); otherwise values spanning more than
    /// [`LOG_SPAN`] get a log scale.
    pub linear: bool,
}

/// Latency curves: each series is a CDF as points (milliseconds, fraction at or below).
#[derive(Debug, Clone)]
pub struct Percentiles {
    pub title: String,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// Drawn as a vertical line, so latencies read as multiples of it.
    pub rtt_ms: Option<f64>,
}

#[derive(Debug, Clone)]
pub enum Chart {
    Bars(Bars),
    Percentiles(Percentiles),
}

#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("nothing to draw: {0}")]
    Empty(&'static str),
    #[error("drawing failed: {0}")]
    Draw(String),
}

fn draw_err<E: std::fmt::Display>(e: E) -> ChartError {
    ChartError::Draw(e.to_string())
}

/// The CDF of sorted samples (any unit), thinned to at most about 400 points that keep the tail.
pub fn cdf_of_sorted(samples: &[f64]) -> Vec<(f64, f64)> {
    let n = samples.len();
    if n == 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut last_q = -1.0f64;
    for (i, v) in samples.iter().enumerate() {
        let q = (i + 1) as f64 / n as f64;
        // Evenly in nines: a point wherever the curve moves by 1% of a nine, and the last.
        if nines(q) - nines(last_q.max(0.0)) >= 0.01 || i + 1 == n {
            out.push((*v, q));
            last_q = q;
        }
    }
    out
}

/// -log10(1 - q), capped at [`NINES`]: 0.9 is one nine, 0.999 three.
fn nines(q: f64) -> f64 {
    if q >= 1.0 {
        NINES
    } else {
        (-(1.0 - q.max(0.0)).log10()).min(NINES)
    }
}

fn nines_label(y: f64) -> String {
    let q = 100.0 * (1.0 - 10f64.powf(-y));
    match y.round() as i64 {
        0 => "0%".into(),
        1 => "90%".into(),
        2 => "99%".into(),
        3 => "99.9%".into(),
        4 => "99.99%".into(),
        _ => format!("{q:.3}%"),
    }
}

/// Draws the charts one under the other in one SVG document.
pub fn render(charts: &[Chart]) -> Result<String, ChartError> {
    if charts.is_empty() {
        return Err(ChartError::Empty("no charts"));
    }
    let mut svg = String::new();
    {
        let height = PANEL * charts.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_err)?;
        let panels = root.split_evenly((charts.len(), 1));
        for (c, area) in charts.iter().zip(&panels) {
            match c {
                Chart::Bars(b) => bars(b, area)?,
                Chart::Percentiles(p) => percentiles(p, area)?,
            }
        }
        root.present().map_err(draw_err)?;
    }
    Ok(svg)
}

/// An axis value: as [`label`] without trailing zeros (0.1, 0.25, 100), and 0 as 0.
fn axis_label(v: f64) -> String {
    if v.abs() < 1e-12 {
        return "0".into();
    }
    let l = label(v);
    if l.contains('.') {
        l.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        l
    }
}

/// The series' legend, at `pos`, over a light background.
fn legend<'a, 'b: 'a>(
    chart: &mut ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    pos: SeriesLabelPosition,
) -> Result<(), ChartError> {
    chart
        .configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(draw_err)
}

/// Three significant digits (no fewer whole ones): 160, 11.2, 4.10, 0.128, 0.00170.
fn label(v: f64) -> String {
    if !v.is_finite() || v <= 0.0 {
        return format!("{v}");
    }
    let decimals = (2 - v.log10().floor() as i32).clamp(0, 9) as usize;
    format!("{v:.decimals$}")
}

/// Bars spanning more than this ratio are drawn on a log scale, so the small ones stay visible.
const LOG_SPAN: f64 = 50.0;

fn bars(b: &Bars, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), ChartError> {
    let values = || {
        b.series
            .iter()
            .flat_map(|(_, v)| v.iter().flatten().copied())
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let top = values().fold(0.0f64, f64::max);
    let low = values().fold(f64::INFINITY, f64::min);
    if b.groups.is_empty() || b.series.is_empty() || top <= 0.0 {
        return Err(ChartError::Empty("bars without a positive value"));
    }
    // On a log scale the axis carries log10 of the value and its labels undo it.
    let log = !b.linear && top / low > LOG_SPAN;
    // Headroom above the tallest bar keeps the legend clear of the bars.
    let (floor, ceil) = if log {
        let floor = low.log10().floor();
        (floor, top.log10() + (top.log10() - floor) * 0.6)
    } else {
        (0.0, top * 1.6)
    };
    let y = move |v: f64| if log { v.log10() } else { v };
    let groups = b.groups.len();
    let n = b.series.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(&b.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..groups as f64, floor..ceil)
        .map_err(draw_err)?;
    let names = b.groups.clone();
    let group_name = move |x: &f64| {
        let i = x.floor() as usize;
        // Labels fall at the middle of each group.
        if (x - i as f64 - 0.5).abs() < 1e-6 {
            names.get(i).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let value_label = move |v: &f64| axis_label(if log { 10f64.powf(*v) } else { *v });
    let unit = if log {
        format!("{} (log scale)", b.unit)
    } else {
        b.unit.clone()
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh()
        .light_line_style(WHITE.mix(0.0))
        .x_labels(groups * 2 + 1)
        .x_label_formatter(&group_name)
        .y_label_formatter(&value_label)
        .y_desc(unit.as_str());
    if log {
        mesh.y_labels((ceil - floor).ceil() as usize + 1);
    }
    mesh.draw().map_err(draw_err)?;
    let w = 0.8 / n;
    for (s, (name, values)) in b.series.iter().enumerate() {
        let color = colour(s);
        let x0 = |g: usize| g as f64 + 0.1 + w * s as f64;
        let shown = || {
            values
                .iter()
                .enumerate()
                .filter_map(|(g, v)| Some((g, v.filter(|v| v.is_finite() && *v > 0.0)?)))
        };
        chart
            .draw_series(shown().map(|(g, v)| {
                Rectangle::new(
                    [(x0(g) + w * 0.06, floor), (x0(g) + w * 0.94, y(v))],
                    color.filled(),
                )
            }))
            .map_err(draw_err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart
            .draw_series(shown().map(|(g, v)| {
                Text::new(
                    label(v),
                    (x0(g) + w * 0.5, y(v) + (ceil - floor) * 0.015),
                    ("sans-serif", 12)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
            }))
            .map_err(draw_err)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

fn percentiles(
    p: &Percentiles,
    area: &DrawingArea<SVGBackend<'_>, Shift>,
) -> Result<(), ChartError> {
    let right = p
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().map(|(ms, _)| *ms))
        .chain(p.rtt_ms)
        .fold(0.0f64, f64::max);
    if p.series.iter().all(|(_, v)| v.is_empty()) || !right.is_finite() || right <= 0.0 {
        return Err(ChartError::Empty("no latency samples"));
    }
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..right * 1.05, 0.0..NINES)
        .map_err(draw_err)?;
    chart
        .configure_mesh()
        .y_labels(NINES as usize + 1)
        .y_label_formatter(&|y| nines_label(*y))
        .x_desc("round trip, ms")
        .y_desc("share of round trips at or below")
        .draw()
        .map_err(draw_err)?;
    if let Some(rtt) = p.rtt_ms {
        chart
            .draw_series(LineSeries::new(
                [(rtt, 0.0), (rtt, NINES)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(draw_err)?
            .label(format!("RTT {rtt:.0} ms"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 14, y)], BLACK.mix(0.5)));
    }
    for (s, (name, points)) in p.series.iter().enumerate() {
        let color = colour(s);
        // A step curve: each point holds until the next latency.
        let mut steps = Vec::with_capacity(points.len() * 2 + 1);
        let mut y = 0.0;
        for (ms, q) in points {
            steps.push((*ms, y));
            y = nines(*q);
            steps.push((*ms, y));
        }
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))
            .map_err(draw_err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], color.stroke_width(2)));
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_and_percentiles_draw_what_they_are_given() {
        let svg = render(&[
            Chart::Bars(Bars {
                title: "first copy".into(),
                unit: "Mbytes/s".into(),
                groups: vec!["redo".into(), "rman".into()],
                series: vec![
                    ("direct CUBIC".into(), vec![Some(0.31), Some(0.29)]),
                    ("wanopt".into(), vec![Some(11.2), None]),
                ],
                linear: false,
            }),
            Chart::Percentiles(Percentiles {
                title: "SYNC".into(),
                series: vec![(
                    "direct BBR".into(),
                    cdf_of_sorted(
                        &(1..=1000)
                            .map(|i| 100.0 + i as f64 / 10.0)
                            .collect::<Vec<_>>(),
                    ),
                )],
                rtt_ms: Some(100.0),
            }),
        ])
        .expect("svg");
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for text in [
            "first copy",
            "direct CUBIC",
            "wanopt",
            "11.2",
            "redo",
            "rman",
            "99.9%",
            "RTT 100 ms",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        // The unmeasured bar is absent, not drawn as zero: two series, three values.
        assert_eq!(svg.matches("0.31").count(), 1);
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn empty_and_degenerate_input_is_refused_not_drawn() {
        assert!(render(&[]).is_err());
        let b = Bars {
            title: "t".into(),
            unit: "u".into(),
            groups: vec!["g".into()],
            series: vec![("s".into(), vec![None])],
            linear: true,
        };
        assert!(render(&[Chart::Bars(b.clone())]).is_err());
        let nan = Bars {
            series: vec![("s".into(), vec![Some(f64::NAN)])],
            ..b
        };
        assert!(render(&[Chart::Bars(nan)]).is_err());
        assert!(
            render(&[Chart::Percentiles(Percentiles {
                title: "t".into(),
                series: vec![("s".into(), vec![])],
                rtt_ms: None,
            })])
            .is_err()
        );
    }

    #[test]
    fn labels_keep_three_significant_digits() {
        assert_eq!(label(160.4), "160");
        assert_eq!(label(11.23), "11.2");
        assert_eq!(label(4.1), "4.10");
        assert_eq!(label(0.1284), "0.128");
        assert_eq!(label(0.0017), "0.00170");
        assert_eq!(label(1e-12), "0.000000000");
        assert_eq!(axis_label(0.0), "0");
        assert_eq!(axis_label(0.1), "0.1");
        assert_eq!(axis_label(100.0), "100");
    }

    #[test]
    fn the_cdf_keeps_the_tail_and_stays_small() {
        let v: Vec<f64> = (0..1_000_000).map(f64::from).collect();
        let c = cdf_of_sorted(&v);
        assert!(c.len() < 500, "{}", c.len());
        assert_eq!(c.last().copied(), Some((999_999.0, 1.0)));
        // p99.9 is on the curve within a hundredth of a nine.
        assert!(c.iter().any(|(_, q)| (nines(*q) - 3.0).abs() < 0.011));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
    }
}
