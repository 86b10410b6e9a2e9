//! PNG line charts (plotters, with DejaVu Sans embedded so no system font is needed).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::{Error, Result};

/// One named line.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Half-widths of the points' intervals, drawn as error bars (empty: none).
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
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is valid TTF; failure would be a bug in the dejavu crate.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
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

/// Draws `series` into a 960×600 PNG at `path`, with error bars where a series has intervals
/// (and then a line at y = 0, the "no difference" of a paired comparison).
pub fn line_chart(path: &Path, chart: &Chart<'_>, series: &[Series]) -> Result<()> {
    register_font();
    if series.iter().flat_map(spans).next().is_none() {
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
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let colors = [
        RGBColor(0x1f, 0x77, 0xb4),
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x2c, 0xa0, 0x2c),
        RGBColor(0xd6, 0x27, 0x28),
        RGBColor(0x94, 0x67, 0xbd),
        RGBColor(0x8c, 0x56, 0x4b),
        RGBColor(0xe3, 0x77, 0xc2),
        RGBColor(0x7f, 0x7f, 0x7f),
    ];
    macro_rules! draw {
        ($chart:expr) => {{
            let mut c = $chart;
            c.configure_mesh()
                .x_desc(chart.x)
                .y_desc(chart.y)
                .label_style(("sans-serif", 16))
                .draw()
                .map_err(|e| err(path, e))?;
            if intervals && y0 < 0.0 && y1 > 0.0 {
                c.draw_series(LineSeries::new([(x0, 0.0), (x1, 0.0)], BLACK.stroke_width(1)))
                    .map_err(|e| err(path, e))?;
            }
            for (i, s) in series.iter().enumerate() {
                let color = colors[i % colors.len()];
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
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 16))
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(|e| err(path, e))?;
        }};
    }
    let mut builder = ChartBuilder::on(&root);
    builder.caption(chart.title, ("sans-serif", 24)).margin(16).x_label_area_size(48).y_label_area_size(72);
    if chart.log_x {
        let x0 = x0.max(1e-9);
        draw!(builder.build_cartesian_2d((x0 * 0.8..x1 * 1.25).log_scale(), y0..y1).map_err(|e| err(path, e))?);
    } else {
        draw!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|e| err(path, e))?);
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
        line_chart(&path, &Chart { title: "t", x: "x", y: "y", log_x: true }, &s).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let empty = vec![Series::line("nan", vec![(f64::NAN, 1.0)])];
        assert!(line_chart(&path, &Chart { title: "t", x: "x", y: "y", log_x: false }, &empty).is_err());
    }
}
