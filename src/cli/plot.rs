//! Minimal SVG line charts (log-2 x axis; linear or log-10 y), no dependencies.

/// One named line.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points, x > 0.
    pub points: Vec<(f64, f64)>,
    /// Colour index: lines of one group (e.g. one path) share a colour.
    pub group: usize,
    /// Dash index: tells lines of one group apart (e.g. by peer count).
    pub dash: usize,
}

/// Solid, dashed, dotted, dash-dot; cycled.
const DASHES: [&str; 4] = ["none", "9 4", "2 3", "10 3 2 3"];

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders `series` as an SVG document; `log_y` plots y on a log-10 scale.
pub fn lines(title: &str, x_label: &str, y_label: &str, series: &[Series], log_y: bool) -> String {
    let (w, h, left, right, top, bottom) = (900.0, 480.0, 70.0, 300.0, 40.0, 50.0);
    let points = series.iter().flat_map(|s| s.points.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, 0.0f64);
    for &(x, y) in points {
        x_min = x_min.min(x.max(1.0).log2());
        x_max = x_max.max(x.max(1.0).log2());
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if x_min > x_max {
        // No points (a sweep run with `--cells` and no grid cell): empty axes,
        // not an endless tick loop from the sentinels.
        (x_min, x_max, y_min, y_max) = (0.0, 1.0, 1.0, 1.0);
    }
    if x_max <= x_min {
        x_max = x_min + 1.0;
    }
    // Log scale spans whole decades; linear starts at zero.
    let (y_lo, y_hi) = if log_y {
        let lo = y_min.max(1e-3).log10().floor();
        let hi = y_max.max(1e-3).log10().ceil();
        (lo, if hi > lo { hi } else { lo + 1.0 })
    } else {
        (0.0, if y_max > 0.0 { y_max * 1.1 } else { 1.0 })
    };
    let scale_y = |y: f64| if log_y { y.max(1e-3).log10() } else { y };
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let sx = |x: f64| left + (x.max(1.0).log2() - x_min) / (x_max - x_min) * plot_w;
    let sy = |y: f64| top + plot_h - (scale_y(y) - y_lo) / (y_hi - y_lo) * plot_h;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
        w / 2.0,
        escape(title)
    );
    svg += &format!(
        "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{left}\" y1=\"{top}\" x2=\"{left}\" y2=\"{}\" stroke=\"black\"/>\n",
        top + plot_h,
        left + plot_w,
        top + plot_h,
        top + plot_h
    );
    let mut exp = x_min.floor() as i32;
    while f64::from(exp) <= x_max {
        let x = 2f64.powi(exp);
        svg += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            sx(x),
            top + plot_h + 16.0,
            x
        );
        exp += 1;
    }
    let ticks: Vec<f64> = if log_y {
        (y_lo as i32..=y_hi as i32).map(|e| 10f64.powi(e)).collect()
    } else {
        (0..=5).map(|i| y_hi * f64::from(i) / 5.0).collect()
    };
    for y in ticks {
        svg += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n\
             <line x1=\"{left}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\n",
            left - 6.0,
            sy(y) + 4.0,
            if y >= 10.0 {
                format!("{y:.0}")
            } else {
                format!("{y}")
            },
            sy(y),
            left + plot_w,
            sy(y)
        );
    }
    svg += &format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"16\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {:.1})\">{}</text>\n",
        left + plot_w / 2.0,
        h - 12.0,
        escape(x_label),
        top + plot_h / 2.0,
        top + plot_h / 2.0,
        escape(y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[s.group % COLORS.len()];
        let dash = DASHES[s.dash % DASHES.len()];
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        svg += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" \
             stroke-dasharray=\"{dash}\" points=\"{}\"/>\n",
            path.join(" ")
        );
        for &(x, y) in &s.points {
            svg += &format!(
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{color}\"/>\n",
                sx(x),
                sy(y)
            );
        }
        let ly = top + 14.0 + 18.0 * i as f64;
        svg += &format!(
            "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\" \
             stroke-width=\"2\" stroke-dasharray=\"{dash}\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
            left + plot_w + 6.0,
            ly - 4.0,
            left + plot_w + 28.0,
            ly - 4.0,
            left + plot_w + 32.0,
            ly,
            escape(&s.name)
        );
    }
    svg += "</svg>\n";
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_without_points_is_empty_axes() {
        for log_y in [false, true] {
            let empty = [Series {
                name: "none".into(),
                points: Vec::new(),
                group: 0,
                dash: 0,
            }];
            let svg = lines("t", "x", "y", &empty, log_y);
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert!(
                svg.len() < 10_000,
                "a handful of ticks, got {} bytes",
                svg.len()
            );
            let svg = lines("t", "x", "y", &[], log_y);
            assert!(svg.trim_end().ends_with("</svg>"));
        }
    }

    #[test]
    fn a_group_shares_its_colour_and_dashes_tell_its_lines_apart() {
        let line = |group, dash| Series {
            name: format!("g{group} d{dash}"),
            points: vec![(1.0, 1.0), (2.0, 2.0)],
            group,
            dash,
        };
        let svg = lines("t", "x", "y", &[line(0, 0), line(0, 1), line(1, 0)], false);
        let strokes: Vec<&str> = svg.lines().filter(|l| l.starts_with("<polyline")).collect();
        assert_eq!(strokes.len(), 3);
        let colour = |l: &str| l.split("stroke=\"").nth(1).map(|r| r[..7].to_string());
        let dashes = |l: &str| {
            l.split("stroke-dasharray=\"")
                .nth(1)
                .map(|r| r.split('"').next().unwrap_or("").to_string())
        };
        assert_eq!(colour(strokes[0]), colour(strokes[1]));
        assert_ne!(colour(strokes[0]), colour(strokes[2]));
        assert_ne!(dashes(strokes[0]), dashes(strokes[1]));
        assert_eq!(dashes(strokes[0]), dashes(strokes[2]));
    }
}
