//! PNG line and bar charts (plotters, with DejaVu Sans embedded so no system font is needed).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::{Error, Result};

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Half-widths of the points' intervals, drawn as error bars (empty: none; a point whose
    /// half-width is not finite, e.g. NaN for no interval, gets no bar).
    pub errors: Vec<f64>,
}

impl Series {
    /// A line without intervals.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self { name: name.into(), points, errors: Vec::new() }
    }
}

/// Axis titles and scale.
#[derive(Debug, Clone)]
pub struct Chart<'a> {
    /// Chart title.
    pub title: &'a str,
    /// x-axis label.
    pub x: &'a str,
    /// y-axis label.
    pub y: &'a str,
    /// Logarithmic x axis.
    pub log_x: bool,
    /// x counts things (k, n, steps): ticks are labelled 1, 2, 3 (not 1.0, 2.0, 3.0), and none
    /// between whole numbers, also when points are shifted apart around their whole x.
    pub whole_x: bool,
}

/// One labelled bar of a [`bar_chart`].
#[derive(Debug, Clone)]
pub struct Bar {
    /// Its label under the x axis.
    pub label: String,
    /// Its height.
    pub value: f64,
    /// Half-width of its interval, drawn as an error bar (`None`: no interval).
    pub error: Option<f64>,
}

impl Bar {
    /// The interval's half-width, when it has a finite one.
    fn interval(&self) -> Option<f64> {
        self.error.filter(|e| e.is_finite())
    }
}

/// The eight colours of every chart, in the order series and bars take them.
const COLORS: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is valid TTF; failure would be a bug in the dejavu crate.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// The series' legend, at the given place.
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    c: &mut ChartContext<'a, DB, CT>,
    place: SeriesLabelPosition,
    path: &Path,
) -> Result<()> {
    c.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .position(place)
        .draw()
        .map_err(|e| err(path, e))
}

/// The corner (or, when every corner is crowded, the middle of a side) of the plot where the
/// legend hides the least data: each place's legend-sized box is charged for the points, line
/// segments and error bars that fall in it (sampled along their length), in the unit square of
/// the axes. Corners win ties, upper right first, then upper left.
fn legend_place(series: &[Series], to_unit: impl Fn(f64, f64) -> (f64, f64)) -> SeriesLabelPosition {
    // The legend's size as a share of the plot area (about 856 × 490 pixels at 960 × 600):
    // 21 pixels a row at 16 px type, the sample line, and ~9 pixels a character.
    let longest = series.iter().map(|s| s.name.chars().count()).max().unwrap_or(0);
    let (w, h) = ((longest as f64 * 9.0 + 60.0) / 856.0, (series.len() as f64 * 21.0 + 16.0) / 490.0);
    let mut marks: Vec<(f64, f64)> = Vec::new();
    let mut along = |a: (f64, f64), b: (f64, f64)| {
        let (a, b) = (to_unit(a.0, a.1), to_unit(b.0, b.1));
        marks.extend((0..=16).map(|i| {
            let t = i as f64 / 16.0;
            (a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1))
        }));
    };
    for s in series {
        let points: Vec<(f64, f64)> = s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        for pair in points.windows(2) {
            along(pair[0], pair[1]);
        }
        if let [only] = points[..] {
            along(only, only);
        }
        if !s.errors.is_empty() {
            for (x, lo, hi) in spans(s) {
                along((x, lo), (x, hi));
            }
        }
    }
    // Vertical places: the box's lowest and highest y.
    let (upper, lower, middle) = ((1.0 - h, 1.0), (0.0, h), (0.5 - h / 2.0, 0.5 + h / 2.0));
    let hidden = |right: bool, (lo, hi): (f64, f64)| {
        marks.iter().filter(|&&(x, y)| (if right { x > 1.0 - w } else { x < w }) && y > lo && y < hi).count()
    };
    let places = [
        (SeriesLabelPosition::UpperRight, hidden(true, upper)),
        (SeriesLabelPosition::UpperLeft, hidden(false, upper)),
        (SeriesLabelPosition::LowerRight, hidden(true, lower)),
        (SeriesLabelPosition::LowerLeft, hidden(false, lower)),
        (SeriesLabelPosition::MiddleRight, hidden(true, middle)),
        (SeriesLabelPosition::MiddleLeft, hidden(false, middle)),
    ];
    places.into_iter().min_by_key(|&(_, n)| n).map(|(c, _)| c).expect("six places")
}

/// An x tick's label on a [`Chart::whole_x`] axis.
fn whole_tick_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round())
    } else {
        String::new()
    }
}

fn err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.to_path_buf(), source: std::io::Error::other(e.to_string()) }
}

/// A point's interval: `(x, y − e, y + e)`, or the point itself without one.
fn spans(s: &Series) -> impl Iterator<Item = (f64, f64, f64)> + '_ {
    s.points.iter().enumerate().filter(|(_, p)| p.0.is_finite() && p.1.is_finite()).map(|(i, &(x, y))| {
        let e = s.errors.get(i).copied().filter(|e| e.is_finite()).unwrap_or(0.0);
        (x, y - e, y + e)
    })
}

/// Whether any series has a point [`line_chart`] can draw (both coordinates finite): a chart
/// without one is an error there, so writers check first and leave such a chart out.
pub fn has_points(series: &[Series]) -> bool {
    series.iter().flat_map(spans).next().is_some()
}

/// Draws `series` into a 960×600 PNG at `path`, with error bars where a series has intervals
/// (and then a line at y = 0, the "no difference" of a paired comparison).
pub fn line_chart(path: &Path, chart: &Chart<'_>, series: &[Series]) -> Result<()> {
    register_font();
    if !has_points(series) {
        return Err(Error::Input(format!("{}: no finite points to plot", path.display())));
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, lo, hi) in series.iter().flat_map(spans) {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(lo), y1.max(hi));
    }
    let intervals = series.iter().any(|s| !s.errors.is_empty());
    if intervals {
        // Room for the outermost error bars' caps.
        let xpad = ((x1 - x0) * 0.03).max(0.05);
        (x0, x1) = (x0 - xpad, x1 + xpad);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let (y0, y1) = (y0 - pad, y1 + pad);
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    // A log axis gets a margin of a quarter of a factor either side.
    let log_range = x0.max(1e-9) * 0.8..x1 * 1.25;
    let unit_x = |x: f64| {
        if chart.log_x {
            let (a, b) = (log_range.start.ln(), log_range.end.ln());
            (x.max(1e-300).ln() - a) / (b - a)
        } else {
            (x - x0) / (x1 - x0)
        }
    };
    let place = legend_place(series, |x, y| (unit_x(x), (y - y0) / (y1 - y0)));
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    macro_rules! draw {
        ($chart:expr) => {{
            let mut c = $chart;
            let mut mesh = c.configure_mesh();
            mesh.x_desc(chart.x).y_desc(chart.y).label_style(("sans-serif", 16));
            if chart.whole_x {
                mesh.x_label_formatter(&whole_tick_label);
            }
            mesh.draw().map_err(|e| err(path, e))?;
            if intervals && y0 < 0.0 && y1 > 0.0 {
                c.draw_series(LineSeries::new([(x0, 0.0), (x1, 0.0)], BLACK.stroke_width(1)))
                    .map_err(|e| err(path, e))?;
            }
            for (i, s) in series.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                let points: Vec<(f64, f64)> =
                    s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
                c.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                    .map_err(|e| err(path, e))?
                    .label(s.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
                if points.len() <= 60 {
                    c.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                        .map_err(|e| err(path, e))?;
                }
                if !s.errors.is_empty() {
                    c.draw_series(spans(s).map(|(x, lo, hi)| {
                        ErrorBar::new_vertical(x, lo, (lo + hi) / 2.0, hi, color.stroke_width(2), 8)
                    }))
                    .map_err(|e| err(path, e))?;
                }
            }
            legend(&mut c, place, path)?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder.caption(chart.title, ("sans-serif", 24)).margin(16).x_label_area_size(48).y_label_area_size(72);
    if chart.log_x {
        draw!(builder.build_cartesian_2d(log_range.clone().log_scale(), y0..y1).map_err(|e| err(path, e))?);
    } else {
        draw!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err(path, e))?);
    }
    root.present().map_err(|e| err(path, e))?;
    Ok(())
}

/// Draws `bars` side by side into a 960×600 PNG at `path`, each with its value written above
/// it and its error bar if it has one; a line at y = 0 when the bars straddle it, and a dashed
/// line at `reference` (such as chance) when given.
pub fn bar_chart(path: &Path, title: &str, y: &str, bars: &[Bar], reference: Option<(&str, f64)>) -> Result<()> {
    register_font();
    if bars.is_empty() || bars.iter().any(|b| !b.value.is_finite()) {
        return Err(Error::Input(format!("{}: bars need finite values", path.display())));
    }
    let ends = |b: &Bar| {
        let e = b.interval().unwrap_or(0.0);
        [b.value - e, b.value + e]
    };
    let (mut y0, mut y1) = (0f64, 0f64);
    for v in bars.iter().flat_map(ends).chain(reference.map(|r| r.1)) {
        (y0, y1) = (y0.min(v), y1.max(v));
    }
    // Room for the labels above the bars, and for the legend above them when there is one.
    let headroom = if reference.is_some() { 0.3 } else { 0.12 };
    let pad = ((y1 - y0) * headroom).max(1e-3);
    let (y0, y1) = (if y0 < 0.0 { y0 - pad } else { 0.0 }, if y1 > 0.0 { y1 + pad } else { 0.0 });
    let n = bars.len();
    // Wide enough for every bar's label (~18 characters) side by side.
    let width = 960.max(150 * n as u32 + 100);
    let root = BitMapBackend::new(path, (width, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5..n as f64 - 0.5, y0..y1)
        .map_err(|e| err(path, e))?;
    let label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            bars[i as usize].label.clone()
        } else {
            String::new()
        }
    };
    c.configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .x_labels(n)
        .x_label_formatter(&label)
        .y_desc(y)
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(|e| err(path, e))?;
    c.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let x = i as f64;
        Rectangle::new([(x - 0.3, 0.0), (x + 0.3, b.value)], COLORS[i % COLORS.len()].mix(0.8).filled())
    }))
    .map_err(|e| err(path, e))?;
    // Error bars: a vertical line with a cap at each end.
    for (i, b) in bars.iter().enumerate() {
        let Some(e) = b.interval() else { continue };
        let (x, lo, hi) = (i as f64, b.value - e, b.value + e);
        let lines =
            [vec![(x, lo), (x, hi)], vec![(x - 0.06, lo), (x + 0.06, lo)], vec![(x - 0.06, hi), (x + 0.06, hi)]];
        c.draw_series(lines.into_iter().map(|l| PathElement::new(l, BLACK.stroke_width(2))))
            .map_err(|e| err(path, e))?;
    }
    // Each bar's value beyond its end (above a positive bar, below a negative one).
    c.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let text = match b.interval() {
            Some(e) => format!("{:.3} ± {:.3}", b.value, e),
            None => format!("{:.3}", b.value),
        };
        let [lo, hi] = ends(b);
        // A negative bar's label hangs below its interval, clear of the lower cap.
        let (y, v) = if b.value < 0.0 { (lo - 0.25 * pad, VPos::Top) } else { (hi + 0.1 * pad, VPos::Bottom) };
        let style = TextStyle::from(("sans-serif", 16).into_font()).pos(Pos::new(HPos::Center, v));
        Text::new(text, (i as f64, y), style)
    }))
    .map_err(|e| err(path, e))?;
    if y0 < 0.0 && y1 > 0.0 {
        c.draw_series(LineSeries::new([(-0.5, 0.0), (n as f64 - 0.5, 0.0)], BLACK.stroke_width(1)))
            .map_err(|e| err(path, e))?;
    }
    if let Some((name, v)) = reference {
        c.draw_series(DashedLineSeries::new([(-0.5, v), (n as f64 - 0.5, v)], 8, 6, BLACK.stroke_width(1)))
            .map_err(|e| err(path, e))?
            .label(name.to_string())
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
        legend(&mut c, SeriesLabelPosition::UpperRight, path)?;
    }
    root.present().map_err(|e| err(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.png");
        let s = vec![
            Series::line("a", vec![(1.0, 2.0), (2.0, 1.5), (3.0, 1.2)]),
            Series { name: "b".into(), points: vec![(1.0, 2.1), (3.0, -1.0)], errors: vec![0.5, 1.5] },
        ];
        line_chart(&path, &Chart { title: "t", x: "x", y: "y", log_x: true, whole_x: true }, &s).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let empty = vec![Series::line("nan", vec![(f64::NAN, 1.0)])];
        assert!(!has_points(&empty) && has_points(&s) && !has_points(&[]));
        assert!(line_chart(&path, &Chart { title: "t", x: "x", y: "y", log_x: false, whole_x: false }, &empty).is_err());
    }

    #[test]
    fn the_legend_goes_where_it_hides_the_least() {
        let unit = |x: f64, y: f64| (x, y);
        let rising = [Series::line("up", vec![(0.0, 0.0), (1.0, 1.0)])];
        assert_eq!(legend_place(&rising, unit), SeriesLabelPosition::UpperLeft, "the line runs through upper right");
        let falling = [Series::line("down", vec![(0.0, 1.0), (1.0, 0.0)])];
        assert_eq!(legend_place(&falling, unit), SeriesLabelPosition::UpperRight, "the default when it is free");
        let top =
            [Series::line("top", vec![(0.0, 0.98), (1.0, 0.98)]), Series::line("rise", vec![(0.0, 0.0), (1.0, 0.5)])];
        assert_eq!(
            legend_place(&top, unit),
            SeriesLabelPosition::LowerRight,
            "a high line, and a rise from the lower left"
        );
        let edges =
            [Series::line("high", vec![(0.0, 0.97), (1.0, 0.97)]), Series::line("low", vec![(0.0, 0.03), (1.0, 0.03)])];
        assert_eq!(legend_place(&edges, unit), SeriesLabelPosition::MiddleRight, "every corner is crossed");
        // An error bar counts along its length.
        let bar = [Series { name: "bar".into(), points: vec![(1.0, 0.5), (0.0, 0.0)], errors: vec![0.5, 0.0] }];
        assert_ne!(legend_place(&bar, unit), SeriesLabelPosition::UpperRight);
        assert_eq!(whole_tick_label(&3.0), "3");
        assert_eq!(whole_tick_label(&2.5), "");
    }

    #[test]
    fn draws_bars_and_refuses_non_finite_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.png");
        let bar = |label: &str, value: f64, error: Option<f64>| Bar { label: label.into(), value, error };
        let bars = vec![bar("down", -2.3, Some(0.25)), bar("up", 2.0, Some(0.16)), bar("plain", -19.0, None)];
        bar_chart(&path, "t", "y", &bars, Some(("chance", 0.5))).unwrap();
        assert_eq!(&std::fs::read(&path).unwrap()[1..4], b"PNG");
        assert!(bar_chart(&path, "t", "y", &[bar("nan", f64::NAN, None)], None).is_err());
        assert!(bar_chart(&path, "t", "y", &[], None).is_err());
    }
}
