//! Moving gradients between `.grad` and the buckets: into a bucket slice when ready, out as
//! the average at the end of backward, `.grad` as a bucket view (`gradient_as_bucket_view`),
//! and letting go of fresh gradients early.

use crate::error::Result;
use crate::reducer::autograd::set_grad;
use crate::reducer::buckets::Layout;
use crate::reducer::pass::Pass;

/// Copies parameter `index`'s gradient into its bucket slice (with
/// `gradient_as_bucket_view`, re-points `.grad` at the slice if autograd replaced it).
pub(crate) fn copy_grad_into_bucket(
    layout: &Layout,
    index: usize,
    as_view: bool,
    rank: usize,
) -> Result<()> {
    let p = &layout.params[index];
    let view = layout.view(index);
    let grad = p.tensor.grad();
    tch::no_grad(|| {
        if !grad.defined() {
            let _ = view.shallow_clone().zero_();
            return Ok(());
        }
        if as_view && grad.data_ptr() == view.data_ptr() {
            return Ok(());
        }
        view.shallow_clone().copy_(&grad);
        if as_view {
            set_grad(&p.tensor, Some(view), rank)?;
        }
        Ok(())
    })
}

/// After its copy into the bucket, lets go of a copied member's `.grad` when it was None
/// before this pass (so autograd allocated it during this backward and nobody else holds
/// it); a copy of the average is written at the end of backward. Small gradients that stay
/// alive between the large ones allocated during backward fragment glibc's heap, which then
/// returns and re-faults large blocks every step (10-15% of a step in docs/PERFORMANCE.md).
pub(crate) fn release_fresh_grad(
    layout: &Layout,
    pass: &mut Pass,
    index: usize,
    rank: usize,
) -> Result<()> {
    let p = &layout.params[index];
    if pass.params[index].fresh_grad && p.tensor.grad().defined() {
        set_grad(&p.tensor, None, rank)?;
        pass.params[index].released = true;
    }
    Ok(())
}

/// A released member got a second gradient in the same pass: its slice holds the first
/// part and autograd started a fresh `.grad` for the rest, which joins the slice.
pub(crate) fn add_second_gradient(layout: &Layout, index: usize, rank: usize) -> Result<()> {
    let p = &layout.params[index];
    let grad = p.tensor.grad();
    if grad.defined() {
        let _ = tch::no_grad(|| layout.view(index).shallow_clone().g_add_(&grad));
        set_grad(&p.tensor, None, rank)?;
    }
    Ok(())
}

/// An unfinished pass: released gradients come back (their slices hold them), unaveraged.
pub(crate) fn restore_released(layout: &Layout, pass: &Pass, rank: usize) -> Result<()> {
    tch::no_grad(|| {
        for (i, p) in layout.params.iter().enumerate() {
            if pass.params[i].released {
                set_grad(&p.tensor, Some(&layout.view(i).copy()), rank)?;
            }
        }
        Ok(())
    })
}

/// Makes every existing `.grad` its parameter's bucket slice, keeping its values.
pub(crate) fn adopt_bucket_views(layout: &Layout, rank: usize) -> Result<()> {
    tch::no_grad(|| {
        for (i, p) in layout.params.iter().enumerate() {
            if p.in_place {
                continue;
            }
            let grad = p.tensor.grad();
            if !grad.defined() {
                continue; // as in PyTorch, a missing .grad becomes a view once it is produced
            }
            let view = layout.view(i);
            view.shallow_clone().copy_(&grad);
            set_grad(&p.tensor, Some(view), rank)?;
        }
        Ok(())
    })
}

/// The end of a finished pass: every `.grad` gets its average. In-place members already
/// hold it unless a buffer stood in for them; copied members get their slice (a view of it
/// with `gradient_as_bucket_view`). Parameters unused on every rank (`globally_used`) keep
/// `.grad` as it was (None stays None).
pub(crate) fn write_back(
    layout: &Layout,
    pass: &mut Pass,
    globally_used: Option<&[bool]>,
    as_view: bool,
    rank: usize,
) -> Result<()> {
    let unused_everywhere = |i: usize| globally_used.is_some_and(|u| !u[i]);
    tch::no_grad(|| {
        for f in pass.in_place_flight.iter_mut() {
            let Some(buffer) = f.buffer.take() else {
                continue;
            };
            if unused_everywhere(f.param) {
                continue;
            }
            let param = &layout.params[f.param].tensor;
            let grad = param.grad();
            if grad.defined() {
                grad.shallow_clone().copy_(&buffer);
            } else {
                set_grad(param, Some(&buffer), rank)?;
            }
        }
        for (i, p) in layout.params.iter().enumerate() {
            if p.in_place || unused_everywhere(i) {
                continue;
            }
            let view = layout.view(i);
            let grad = p.tensor.grad();
            if as_view {
                if !grad.defined() || grad.data_ptr() != view.data_ptr() {
                    set_grad(&p.tensor, Some(view), rank)?;
                }
            } else if grad.defined() {
                grad.shallow_clone().copy_(view);
            } else {
                set_grad(&p.tensor, Some(&view.copy()), rank)?;
            }
        }
        Ok(())
    })
}
