//! The examples' progress bar (indicatif), included by `train_fsdp` and `train_lm` with
//! `#[path]`. On a terminal it redraws in place. Under a launcher (`tch-dist-run` or
//! torchrun pipe every rank's output and prefix its lines) stderr is no terminal, where
//! indicatif would draw nothing: there the bar is written as whole lines of stdout (stderr
//! keeps the one line of an error), at most one every [`EVERY`], each a snapshot of the bar
//! (the last one when the bar goes), so that the run's progress shows in the launcher's
//! output as well.

use std::io::{self, IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};

/// The least time between two lines of a bar drawn as lines.
pub const EVERY: Duration = Duration::from_secs(3);

/// A bar over `steps` steps, its prefix `prefix` (the epoch), its message set by the caller.
pub fn progress_bar(steps: u64, prefix: String) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(steps), draw_target());
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} epoch {prefix} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(prefix);
    bar
}

fn draw_target() -> ProgressDrawTarget {
    if io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::term_like(Box::new(Lines::default()))
    }
}

/// A "terminal" that writes a drawing of the bar as one line of stdout, at most one every
/// [`EVERY`]; cursor moves and clears are dropped, so a line is appended, not redrawn.
#[derive(Debug, Default)]
struct Lines {
    state: Mutex<LinesState>,
}

#[derive(Debug, Default)]
struct LinesState {
    /// What has been written of the drawing in progress.
    pending: String,
    /// The newest complete drawing not written yet.
    latest: Option<String>,
    /// When the last line was written.
    written: Option<Instant>,
}

impl Lines {
    fn state(&self) -> std::sync::MutexGuard<'_, LinesState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the drawing in progress: written now if [`EVERY`] has passed, else kept as the
    /// latest.
    fn end_drawing(&self) -> io::Result<()> {
        let mut st = self.state();
        let line = std::mem::take(&mut st.pending).trim_end().to_string();
        if line.trim().is_empty() {
            return Ok(());
        }
        if st.written.is_some_and(|t| t.elapsed() < EVERY) {
            st.latest = Some(line);
            return Ok(());
        }
        st.written = Some(Instant::now());
        st.latest = None;
        writeln!(io::stdout().lock(), "{line}")
    }
}

impl Drop for Lines {
    /// The bar's last state (its end), if it was not written.
    fn drop(&mut self) {
        if let Some(line) = self.state().latest.take() {
            let _ = writeln!(io::stdout().lock(), "{line}");
        }
    }
}

impl TermLike for Lines {
    fn width(&self) -> u16 {
        100
    }

    fn move_cursor_up(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_down(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_right(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn move_cursor_left(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn write_line(&self, s: &str) -> io::Result<()> {
        self.state().pending.push_str(s);
        self.end_drawing()
    }

    fn write_str(&self, s: &str) -> io::Result<()> {
        self.state().pending.push_str(s);
        Ok(())
    }

    fn clear_line(&self) -> io::Result<()> {
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.end_drawing()?;
        io::stdout().flush()
    }
}
