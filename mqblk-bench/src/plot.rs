//! `iops.png`: IOPS against jobs, one panel per workload and iodepth, one line per series
//! (backend/mapping), medians with min–max bars.
//!
//! Drawn by hand into an RGB buffer and written with the `png` crate; text is rasterised with
//! `ab_glyph` from a TrueType font found on the system (Debian's fonts-dejavu-core). Without a
//! font the plot is drawn without text, and report.md describes the axes and series.

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use ab_glyph::{Font, FontVec, PxScale, ScaleFont};
use anyhow::Context;

use super::report::{BenchResults, PointResult};

const PANEL_W: usize = 640;
const PANEL_H: usize = 420;
const COLS: usize = 2;

const PALETTE: [[u8; 3]; 10] = [
    [31, 119, 180],
    [214, 39, 40],
    [44, 160, 44],
    [255, 127, 14],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];
const BLACK: [u8; 3] = [0, 0, 0];
const GREY: [u8; 3] = [225, 225, 225];

/// A TrueType font for the labels, if the system has one.
pub fn find_font() -> Option<PathBuf> {
    [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
    font: Option<FontVec>,
}

impl Canvas {
    fn new(w: usize, h: usize, font: Option<FontVec>) -> Canvas {
        Canvas {
            w,
            h,
            px: vec![255; w * h * 3],
            font,
        }
    }

    fn blend(&mut self, x: i64, y: i64, c: [u8; 3], a: f32) {
        if x < 0 || y < 0 || x as usize >= self.w || y as usize >= self.h {
            return;
        }
        let a = a.clamp(0.0, 1.0);
        let i = (y as usize * self.w + x as usize) * 3;
        for (p, &c) in self.px[i..i + 3].iter_mut().zip(&c) {
            let old = f32::from(*p);
            *p = (old + (f32::from(c) - old) * a).round() as u8;
        }
    }

    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: [u8; 3], a: f32) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.blend(x, y, c, a);
            }
        }
    }

    /// A line `width` pixels wide (a disc swept along it).
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), width: f64, c: [u8; 3]) {
        let len = ((x1 - x0).powi(2) + (y1 - y0).powi(2)).sqrt();
        let steps = (len * 2.0).ceil().max(1.0) as usize;
        let r = width / 2.0;
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            let (cx, cy) = (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t);
            let ri = r.ceil() as i64 + 1;
            for dy in -ri..=ri {
                for dx in -ri..=ri {
                    let (px, py) = (cx.round() as i64 + dx, cy.round() as i64 + dy);
                    let d = ((px as f64 - cx).powi(2) + (py as f64 - cy).powi(2)).sqrt();
                    let cov = (r + 0.5 - d).clamp(0.0, 1.0) as f32;
                    if cov > 0.0 {
                        // Blending towards the colour again only saturates the edge.
                        self.blend(px, py, c, cov);
                    }
                }
            }
        }
    }

    fn text_width(&self, s: &str, size: f32) -> f64 {
        let Some(font) = &self.font else {
            return 0.0;
        };
        let sf = font.as_scaled(PxScale::from(size));
        let mut w = 0.0;
        let mut last = None;
        for ch in s.chars() {
            let id = sf.glyph_id(ch);
            if let Some(l) = last {
                w += sf.kern(l, id);
            }
            w += sf.h_advance(id);
            last = Some(id);
        }
        f64::from(w)
    }

    /// Text with its top-left corner at (x, y).
    fn text(&mut self, x: f64, y: f64, s: &str, size: f32, c: [u8; 3]) {
        let Some(font) = self.font.take() else {
            return;
        };
        {
            let scale = PxScale::from(size);
            let sf = font.as_scaled(scale);
            let mut caret = x as f32;
            let mut last = None;
            for ch in s.chars() {
                let id = sf.glyph_id(ch);
                if let Some(l) = last {
                    caret += sf.kern(l, id);
                }
                let g = id
                    .with_scale_and_position(scale, ab_glyph::point(caret, y as f32 + sf.ascent()));
                caret += sf.h_advance(id);
                last = Some(id);
                if let Some(og) = font.outline_glyph(g) {
                    let b = og.px_bounds();
                    og.draw(|gx, gy, cov| {
                        self.blend(
                            b.min.x as i64 + i64::from(gx),
                            b.min.y as i64 + i64::from(gy),
                            c,
                            cov,
                        )
                    });
                }
            }
        }
        self.font = Some(font);
    }

    fn save(&self, path: &Path) -> anyhow::Result<()> {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut enc = png::Encoder::new(BufWriter::new(f), self.w as u32, self.h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc.write_header().context("writing the PNG header")?;
        wr.write_image_data(&self.px)
            .context("writing the PNG data")?;
        wr.finish().context("finishing the PNG")?;
        Ok(())
    }
}

/// A round step near `range / target` ticks: 1, 2 or 5 times a power of ten.
pub fn nice_step(range: f64, target: usize) -> f64 {
    if range.is_nan() || range <= 0.0 {
        return 1.0;
    }
    let raw = range / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// Short form of a count: 950, 12.5k, 1.2M.
pub fn short(v: f64) -> String {
    let a = v.abs();
    let (x, suffix) = if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let s = if x.fract().abs() < 1e-9 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    };
    format!("{s}{suffix}")
}

/// Draws the plot of `results` into `path`.
pub fn draw(results: &BenchResults, path: &Path, font: Option<&Path>) -> anyhow::Result<()> {
    let font = font
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| FontVec::try_from_vec(b).ok());
    let groups = results.groups();
    let n = groups.len().max(1);
    let cols = n.min(COLS);
    let rows = n.div_ceil(cols);
    let mut c = Canvas::new(cols * PANEL_W, rows * PANEL_H, font);
    // Colours by series label, the same in every panel.
    let mut labels: Vec<String> = Vec::new();
    for p in &results.points {
        if !labels.contains(&p.label) {
            labels.push(p.label.clone());
        }
    }
    for (i, (w, qd, pts)) in groups.iter().enumerate() {
        let ox = (i % cols * PANEL_W) as f64;
        let oy = (i / cols * PANEL_H) as f64;
        panel(&mut c, ox, oy, &format!("{w}, iodepth {qd}"), pts, &labels);
    }
    c.save(path)
}

fn panel(c: &mut Canvas, ox: f64, oy: f64, title: &str, pts: &[&PointResult], labels: &[String]) {
    let (left, right, top, bottom) = (72.0, 16.0, 34.0, 48.0);
    let (x0, x1) = (ox + left, ox + PANEL_W as f64 - right);
    let (y0, y1) = (oy + top, oy + PANEL_H as f64 - bottom); // y0 top, y1 bottom
    let mut jobs: Vec<usize> = pts.iter().map(|p| p.config.jobs).collect();
    jobs.sort_unstable();
    jobs.dedup();
    let ymax_data = pts
        .iter()
        .filter_map(|p| p.summary.iops.map(|s| s.max))
        .fold(0.0f64, f64::max);
    let step = nice_step(ymax_data * 1.05, 5);
    let ymax = ((ymax_data * 1.05 / step).ceil() * step).max(step);
    let xpos = |j: usize| {
        let k = jobs.iter().position(|&x| x == j).unwrap_or(0);
        if jobs.len() == 1 {
            (x0 + x1) / 2.0
        } else {
            x0 + 30.0 + (x1 - x0 - 60.0) * k as f64 / (jobs.len() - 1) as f64
        }
    };
    let ypos = |v: f64| y1 - (y1 - y0) * (v / ymax);

    // Grid, axes, ticks.
    let mut v = 0.0;
    while v <= ymax + step * 0.01 {
        let y = ypos(v).round();
        c.rect(x0 as i64, y as i64, x1 as i64, y as i64, GREY, 1.0);
        let lbl = short(v);
        let tw = c.text_width(&lbl, 12.0);
        c.text(x0 - 6.0 - tw, y - 8.0, &lbl, 12.0, BLACK);
        v += step;
    }
    c.rect(x0 as i64, y0 as i64, x0 as i64, y1 as i64, BLACK, 1.0);
    c.rect(x0 as i64, y1 as i64, x1 as i64, y1 as i64, BLACK, 1.0);
    for &j in &jobs {
        let x = xpos(j).round();
        c.rect(x as i64, y1 as i64, x as i64, y1 as i64 + 4, BLACK, 1.0);
        let lbl = j.to_string();
        let tw = c.text_width(&lbl, 12.0);
        c.text(x - tw / 2.0, y1 + 6.0, &lbl, 12.0, BLACK);
    }
    let tw = c.text_width("jobs", 13.0);
    c.text((x0 + x1) / 2.0 - tw / 2.0, y1 + 24.0, "jobs", 13.0, BLACK);
    c.text(ox + 8.0, oy + 8.0, "IOPS", 13.0, BLACK);
    let tw = c.text_width(title, 15.0);
    c.text((x0 + x1) / 2.0 - tw / 2.0, oy + 8.0, title, 15.0, BLACK);

    // Series.
    let mut present: Vec<&String> = Vec::new();
    let nseries = labels
        .iter()
        .filter(|l| pts.iter().any(|p| &p.label == *l))
        .count();
    for label in labels {
        let mut series: Vec<&&PointResult> = pts.iter().filter(|p| &p.label == label).collect();
        if series.is_empty() {
            continue;
        }
        // Spread the series a little sideways so that their min–max bars do not overlap.
        let dodge = (present.len() as f64 - (nseries as f64 - 1.0) / 2.0) * 5.0;
        present.push(label);
        series.sort_by_key(|p| p.config.jobs);
        let col = PALETTE[labels.iter().position(|l| l == label).unwrap_or(0) % PALETTE.len()];
        let mut prev: Option<(f64, f64)> = None;
        for p in series {
            let Some(s) = p.summary.iops else {
                prev = None;
                continue;
            };
            let x = xpos(p.config.jobs) + dodge;
            let (ylo, yhi, ym) = (ypos(s.min), ypos(s.max), ypos(s.median));
            c.line((x, ylo), (x, yhi), 1.0, col);
            c.line((x - 4.0, ylo), (x + 4.0, ylo), 1.0, col);
            c.line((x - 4.0, yhi), (x + 4.0, yhi), 1.0, col);
            if let Some(pp) = prev {
                c.line(pp, (x, ym), 2.5, col);
            }
            c.rect(
                x as i64 - 3,
                ym as i64 - 3,
                x as i64 + 3,
                ym as i64 + 3,
                col,
                1.0,
            );
            prev = Some((x, ym));
        }
    }

    // Legend, top left inside the plot area.
    if c.font.is_some() && !present.is_empty() {
        let lw = present
            .iter()
            .map(|l| c.text_width(l, 12.0))
            .fold(0.0, f64::max)
            + 36.0;
        let lh = present.len() as f64 * 17.0 + 8.0;
        let (lx, ly) = (x0 + 8.0, y0 + 4.0);
        c.rect(
            lx as i64,
            ly as i64,
            (lx + lw) as i64,
            (ly + lh) as i64,
            [255, 255, 255],
            0.85,
        );
        for (k, label) in present.iter().enumerate() {
            let col = PALETTE[labels.iter().position(|l| l == *label).unwrap_or(0) % PALETTE.len()];
            let y = ly + 6.0 + k as f64 * 17.0;
            c.line((lx + 6.0, y + 7.0), (lx + 26.0, y + 7.0), 2.5, col);
            c.text(lx + 32.0, y - 1.0, label, 12.0, BLACK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_labels() {
        assert_eq!(nice_step(100.0, 5), 20.0);
        assert_eq!(nice_step(1_000_000.0, 5), 200_000.0);
        assert_eq!(nice_step(7.0, 5), 2.0);
        assert_eq!(nice_step(0.0, 5), 1.0);
        assert_eq!(short(0.0), "0");
        assert_eq!(short(950.0), "950");
        assert_eq!(short(150_000.0), "150k");
        assert_eq!(short(12_500.0), "12.5k");
        assert_eq!(short(1_200_000.0), "1.2M");
    }

    #[test]
    fn canvas_draws_and_saves() {
        let mut c = Canvas::new(40, 30, None);
        c.line((0.0, 0.0), (39.0, 29.0), 2.0, [255, 0, 0]);
        c.rect(0, 0, 1, 1, [0, 0, 255], 1.0);
        assert_eq!(&c.px[0..3], &[0, 0, 255]);
        let mid = (15 * 40 + 20) * 3;
        assert!(
            c.px[mid] > 200 && c.px[mid + 1] < 100,
            "line through the middle"
        );
        c.text(0.0, 0.0, "no font: no-op", 12.0, BLACK);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.png");
        c.save(&p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
