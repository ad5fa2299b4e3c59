//! A small SVG chart writer with no dependency: line, dashed-line, point and bar series on
//! linear axes, with ticks at 1-2-5 steps, grid lines, axis labels, a title, a legend outside
//! the plot area (so it never hides data) and labelled vertical markers.
//!
//! Text width is estimated (about 0.6 em per character of a sans-serif font) to lay out the
//! margins and the legend; every coordinate is written with one decimal.

use std::fmt::Write as _;

/// Colours for series, in order (the Okabe-Ito palette without its yellow, which is hard to
/// read on white; distinguishable with the common colour-vision deficiencies).
pub const PALETTE: [&str; 7] = [
    "#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000",
];

/// The colour of the `i`-th series.
pub fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mark {
    Line,
    Dashed,
    /// Circles at the points.
    Points,
    /// A dashed horizontal line across the whole plot at each point's y (x is ignored): a
    /// reference level such as a target.
    HLine,
    /// Bars from 0, centred on the x values (which should be integers: the bars are 0.8 wide).
    Bars,
}

/// One series of (x, y) points. Non-finite points are skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub color: String,
    pub mark: Mark,
    pub points: Vec<(f64, f64)>,
    /// Text written above each point (bar charts); empty for none.
    pub labels: Vec<String>,
    pub width: f64,
    pub opacity: f64,
    /// Whether the legend lists it.
    pub in_legend: bool,
}

impl Series {
    pub fn new(name: impl Into<String>, color: &str, mark: Mark, points: Vec<(f64, f64)>) -> Self {
        Series {
            name: name.into(),
            color: color.into(),
            mark,
            points,
            labels: Vec::new(),
            width: 2.0,
            opacity: 1.0,
            in_legend: true,
        }
    }

    /// A thin, translucent, unlisted line (raw data behind a smoothed one).
    pub fn faint(mut self) -> Self {
        self.width = 1.0;
        self.opacity = 0.3;
        self.in_legend = false;
        self
    }

    pub fn with_labels(mut self, labels: Vec<String>) -> Self {
        self.labels = labels;
        self
    }
}

/// A chart: title, axes, series and vertical markers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chart {
    pub title: String,
    /// A second line under the title saying what is drawn (smoothing, units).
    pub subtitle: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// The y range to show at least (e.g. (0, 1) for rates); the data widens it if needed.
    /// None: from the data, with 0 included when the data is non-negative.
    pub y_min_range: Option<(f64, f64)>,
    /// The x range to show at least (e.g. from step 0); the data widens it if needed.
    pub x_min_range: Option<(f64, f64)>,
    /// Ticks on the x axis at integers only (steps, lags).
    pub integer_x: bool,
    /// Vertical dotted lines with a label at the top (stage boundaries).
    pub markers: Vec<(f64, String)>,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 430.0;
const FONT: f64 = 12.0;
/// How far outside the plot area series may still draw (so a dot or a thick line on the frame
/// is not cut in half; the data itself always lies inside the axes' range).
const CLIP_PAD: f64 = 6.0;

/// The estimated width of `s` in the chart's font.
fn text_width(s: &str, size: f64) -> f64 {
    s.chars().count() as f64 * 0.6 * size
}

/// Splits `text` at spaces into lines at most `width` wide (a longer word gets its own line).
fn wrap(text: &str, width: f64, size: f64) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split_whitespace() {
        match lines.last_mut() {
            Some(l) if text_width(l, size) + text_width(word, size) + 0.6 * size <= width => {
                l.push(' ');
                l.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    lines
}

/// Escapes text for an XML text node or attribute.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // Control characters are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => {}
            c => out.push(c),
        }
    }
    out
}

/// Tick positions for [lo, hi]: about `target` ticks at a step of 1, 2 or 5 times a power of
/// ten; returns (axis lo, axis hi, step) with the axis widened to whole steps.
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> (f64, f64, f64) {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag);
    let a = (lo / step + 1e-9).floor() * step;
    let b = (hi / step - 1e-9).ceil() * step;
    (a, b.max(a + step), step)
}

/// A tick label of an axis whose largest magnitude is `extent`: one k/M suffix for the whole
/// axis when it reaches 10^4 (10^6), and as many decimals as the step needs.
pub fn tick_label(v: f64, step: f64, extent: f64) -> String {
    let (scale, suffix) = if extent >= 1e6 {
        (1e6, "M")
    } else if extent >= 1e4 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    let s = step / scale;
    let decimals = if s >= 1.0 {
        0
    } else {
        ((-s.log10()).ceil() as usize).min(6)
    };
    let x = v / scale;
    if x.abs() < s * 1e-6 {
        // Zero is "0" on any axis (not "0k", "-0" or "0.00").
        return "0".into();
    }
    format!("{x:.decimals$}{suffix}")
}

/// The points of every series that can be drawn.
fn finite(points: &[(f64, f64)]) -> impl Iterator<Item = (f64, f64)> + '_ {
    points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
}

/// Data bounds over all series (and markers for x).
fn bounds(c: &Chart) -> Option<((f64, f64), (f64, f64))> {
    let mut xs = (f64::INFINITY, f64::NEG_INFINITY);
    let mut ys = (f64::INFINITY, f64::NEG_INFINITY);
    let mut any = false;
    for s in &c.series {
        for (x, y) in finite(&s.points) {
            ys = (ys.0.min(y), ys.1.max(y));
            if s.mark == Mark::HLine {
                // A reference level: it widens y, never x, and is not data by itself.
                continue;
            }
            any = true;
            xs = (xs.0.min(x), xs.1.max(x));
            if s.mark == Mark::Bars {
                ys = (ys.0.min(0.0), ys.1.max(0.0));
            }
        }
    }
    if !any {
        return None;
    }
    for (x, _) in &c.markers {
        if x.is_finite() {
            xs = (xs.0.min(*x), xs.1.max(*x));
        }
    }
    if let Some((a, b)) = c.x_min_range {
        xs = (xs.0.min(a), xs.1.max(b));
    }
    Some((xs, ys))
}

impl Chart {
    /// Whether any series has a point to draw.
    pub fn has_data(&self) -> bool {
        bounds(self).is_some()
    }

    /// The chart as an SVG document; None when no series has a point to draw.
    pub fn to_svg(&self) -> Option<String> {
        let ((x0, x1), (y0, y1)) = bounds(self)?;
        let bars = self.series.iter().any(|s| s.mark == Mark::Bars);
        // x range: bars need half a unit on each side; a single x needs some width.
        let (x0, x1) = if bars {
            (x0 - 0.5, x1 + 0.5)
        } else if x1 - x0 < 1e-12 {
            (x0 - 1.0, x1 + 1.0)
        } else {
            (x0, x1)
        };
        let (mut y0, mut y1) = (y0, y1);
        match self.y_min_range {
            Some((a, b)) => {
                y0 = y0.min(a);
                y1 = y1.max(b);
            }
            None => {
                if y0 >= 0.0 {
                    y0 = 0.0;
                }
                // Headroom so the top of a curve or bar label is not on the frame.
                y1 += 0.08 * (y1 - y0).max(y1.abs() * 0.1).max(1e-9);
            }
        }
        let (y0, y1, ystep) = nice_ticks(y0, y1, 6);
        let y_ext = y0.abs().max(y1.abs());
        let x_ext = x0.abs().max(x1.abs());
        let xstep = if self.integer_x {
            nice_ticks(x0, x1, 10).2.max(1.0).round()
        } else {
            nice_ticks(x0, x1, 8).2
        };

        // Margins from the text they hold.
        let y_tick_w = [y0, y1, (y0 + y1) / 2.0]
            .iter()
            .map(|&v| text_width(&tick_label(v, ystep, y_ext), FONT))
            .fold(0.0, f64::max);
        let left = 20.0 + FONT + 8.0 + y_tick_w + 8.0;
        let legend: Vec<&Series> = self.series.iter().filter(|s| s.in_legend).collect();
        let legend_w = legend
            .iter()
            .map(|s| text_width(&s.name, FONT))
            .fold(0.0, f64::max);
        let right = if legend.is_empty() {
            24.0
        } else {
            legend_w + 28.0 + 24.0
        };
        // The subtitle wraps at the chart's width.
        let subtitle = wrap(&self.subtitle, WIDTH - left - 16.0, FONT);
        let top = 44.0 + 16.0 * subtitle.len() as f64;
        let bottom = 58.0;
        let (pw, ph) = (WIDTH - left - right, HEIGHT - top - bottom);
        let sx = |x: f64| left + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| top + (y1 - y) / (y1 - y0) * ph;

        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="{FONT}">"#
        );
        let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<defs><clipPath id="plot"><rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}"/></clipPath></defs>"#,
            left - CLIP_PAD,
            top - CLIP_PAD,
            pw + 2.0 * CLIP_PAD,
            ph + 2.0 * CLIP_PAD
        );
        // Title and subtitle.
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="24" font-size="16" font-weight="bold">{}</text>"#,
            left,
            escape(&self.title)
        );
        for (i, line) in subtitle.iter().enumerate() {
            let _ = writeln!(
                o,
                r##"<text x="{:.1}" y="{:.1}" fill="#555">{}</text>"##,
                left,
                44.0 + 16.0 * i as f64,
                escape(line)
            );
        }

        // Grid and y ticks.
        let ny = ((y1 - y0) / ystep).round() as usize;
        for i in 0..=ny {
            let v = y0 + i as f64 * ystep;
            let y = sy(v);
            let _ = writeln!(
                o,
                r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e4e4e4"/>"##,
                left,
                left + pw
            );
            let _ = writeln!(
                o,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                left - 8.0,
                y + FONT * 0.35,
                escape(&tick_label(v, ystep, y_ext))
            );
        }
        // x ticks: multiples of the step inside the range, thinned until the labels fit.
        let mut first = (x0 / xstep).ceil();
        let last = (x1 / xstep + 1e-9).floor();
        let mut every = 1.0;
        let label_w = [first * xstep, last * xstep]
            .iter()
            .map(|&v| text_width(&tick_label(v, xstep, x_ext), FONT))
            .fold(0.0, f64::max)
            + 10.0;
        while (last - first) / every > 0.0 && pw / ((last - first) / every + 1.0) < label_w {
            every *= 2.0;
        }
        if first * xstep < x0 - 1e-9 {
            first += 1.0;
        }
        let mut k = first;
        while k <= last + 1e-9 {
            let v = k * xstep;
            let x = sx(v);
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#e4e4e4"/>"##,
                top,
                top + ph
            );
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333"/>"##,
                top + ph,
                top + ph + 5.0
            );
            let _ = writeln!(
                o,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                top + ph + 5.0 + FONT + 2.0,
                escape(&tick_label(v, xstep, x_ext))
            );
            k += every;
        }
        // Axis labels.
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            left + pw / 2.0,
            HEIGHT - 14.0,
            escape(&self.x_label)
        );
        let (lx, ly) = (20.0 + FONT * 0.5, top + ph / 2.0);
        let _ = writeln!(
            o,
            r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle" transform="rotate(-90 {lx:.1} {ly:.1})">{}</text>"#,
            escape(&self.y_label)
        );

        // Markers.
        for (i, (mx, label)) in self.markers.iter().enumerate() {
            if !mx.is_finite() {
                continue;
            }
            let x = sx(*mx);
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#888" stroke-dasharray="2 3"/>"##,
                top,
                top + ph
            );
            // Alternate rows so labels of close markers do not overlap.
            let _ = writeln!(
                o,
                r##"<text x="{:.1}" y="{:.1}" fill="#666" font-size="11">{}</text>"##,
                x + 4.0,
                top + 13.0 + (i % 2) as f64 * 13.0,
                escape(label)
            );
        }

        // Series, clipped to the plot.
        let _ = writeln!(o, r#"<g clip-path="url(#plot)">"#);
        let bar_w = (pw / (x1 - x0) * 0.8).max(1.0);
        for s in &self.series {
            let color = escape(&s.color);
            let pts: Vec<(f64, f64)> = finite(&s.points).collect();
            match s.mark {
                Mark::Line | Mark::Dashed => {
                    let dash = if s.mark == Mark::Dashed {
                        r#" stroke-dasharray="7 5""#
                    } else {
                        ""
                    };
                    let path: Vec<String> = pts
                        .iter()
                        .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                        .collect();
                    if pts.len() == 1 {
                        // One point: a line has no length, so draw a dot.
                        let _ = writeln!(
                            o,
                            r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}" opacity="{}"/>"#,
                            sx(pts[0].0),
                            sy(pts[0].1),
                            s.opacity
                        );
                    } else {
                        let _ = writeln!(
                            o,
                            r#"<polyline fill="none" stroke="{color}" stroke-width="{}" stroke-opacity="{}" stroke-linejoin="round"{dash} points="{}"/>"#,
                            s.width,
                            s.opacity,
                            path.join(" ")
                        );
                    }
                }
                // Drawn after the clipped group, whole even on the frame.
                Mark::Points => {}
                Mark::HLine => {
                    for &(_, y) in &pts {
                        let _ = writeln!(
                            o,
                            r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="{}" stroke-opacity="{}" stroke-dasharray="7 5"/>"#,
                            left,
                            sy(y),
                            left + pw,
                            sy(y),
                            s.width,
                            s.opacity
                        );
                    }
                }
                Mark::Bars => {
                    for &(x, y) in &pts {
                        let (ya, yb) = (sy(y.max(0.0)), sy(y.min(0.0)));
                        let _ = writeln!(
                            o,
                            r#"<rect x="{:.1}" y="{ya:.1}" width="{bar_w:.1}" height="{:.1}" fill="{color}" opacity="{}"/>"#,
                            sx(x) - bar_w / 2.0,
                            (yb - ya).max(0.5),
                            s.opacity
                        );
                    }
                }
            }
        }
        let _ = writeln!(o, "</g>");
        for s in self.series.iter().filter(|s| s.mark == Mark::Points) {
            for (x, y) in finite(&s.points) {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="5" fill="{}" stroke="white" stroke-width="1.5" opacity="{}"/>"#,
                    sx(x),
                    sy(y),
                    escape(&s.color),
                    s.opacity
                );
            }
        }
        // Point labels (outside the clip so a label over the top bar stays readable).
        for s in &self.series {
            for (&(x, y), label) in s.points.iter().zip(&s.labels) {
                if !(x.is_finite() && y.is_finite()) || label.is_empty() {
                    continue;
                }
                let _ = writeln!(
                    o,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="11" fill="#333">{}</text>"##,
                    sx(x),
                    sy(y.max(0.0)) - 4.0,
                    escape(label)
                );
            }
        }
        // Axes.
        let _ = writeln!(
            o,
            r##"<polyline fill="none" stroke="#333" points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}"/>"##,
            left,
            top,
            left,
            top + ph,
            left + pw,
            top + ph
        );
        // Legend, right of the plot.
        let lx = left + pw + 16.0;
        for (i, s) in legend.iter().enumerate() {
            let y = top + 8.0 + i as f64 * (FONT + 8.0);
            let color = escape(&s.color);
            match s.mark {
                Mark::Line | Mark::Dashed | Mark::HLine => {
                    let dash = if s.mark != Mark::Line {
                        r#" stroke-dasharray="5 3""#
                    } else {
                        ""
                    };
                    let _ = writeln!(
                        o,
                        r#"<line x1="{lx:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="{}"{dash}/>"#,
                        lx + 20.0,
                        s.width.max(2.0)
                    );
                }
                Mark::Points => {
                    let _ = writeln!(
                        o,
                        r#"<circle cx="{:.1}" cy="{y:.1}" r="5" fill="{color}"/>"#,
                        lx + 10.0
                    );
                }
                Mark::Bars => {
                    let _ = writeln!(
                        o,
                        r#"<rect x="{:.1}" y="{:.1}" width="14" height="10" fill="{color}"/>"#,
                        lx + 3.0,
                        y - 5.0
                    );
                }
            }
            let _ = writeln!(
                o,
                r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
                lx + 26.0,
                y + FONT * 0.35,
                escape(&s.name)
            );
        }
        o.push_str("</svg>\n");
        Some(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(nice_ticks(0.0, 1.0, 5), (0.0, 1.0, 0.2));
        let (a, b, s) = nice_ticks(3.0, 97.0, 6);
        assert_eq!((a, b, s), (0.0, 100.0, 20.0));
        let (a, b, s) = nice_ticks(-0.3, 0.7, 5);
        assert!((s - 0.2).abs() < 1e-12 && a <= -0.3 && b >= 0.7);
        assert_eq!(tick_label(12000.0, 2000.0, 12000.0), "12k");
        assert_eq!(tick_label(1500.0, 500.0, 2000.0), "1500");
        assert_eq!(tick_label(1500.0, 500.0, 20000.0), "1.5k");
        assert_eq!(tick_label(0.4, 0.2, 1.0), "0.4");
        assert_eq!(tick_label(-0.0, 0.2, 1.0), "0");
        assert_eq!(tick_label(1e-17, 2000.0, 1e4), "0");
        assert_eq!(tick_label(25.0, 5.0, 30.0), "25");
        assert_eq!(tick_label(3e7, 1e7, 5e7), "30M");
        assert_eq!(tick_label(2.5e6, 5e5, 4e6), "2.5M");
        assert_eq!(tick_label(8e5, 2e5, 8e5), "800k");
    }

    #[test]
    fn escaping_keeps_text_out_of_markup() {
        assert_eq!(escape("a<b & \"c\"\u{1}"), "a&lt;b &amp; &quot;c&quot;");
    }
}
