//! CUDA graphs: the work queued on a stream captured once and replayed with one launch.

use super::driver::Context;
use crate::status::Result;
use cudarc::driver::sys as cu;
use std::sync::Arc;

fn cu_check(r: cu::CUresult, what: &str) -> Result<()> {
    super::driver::check(r, what)
}

/// An instantiated CUDA graph: a plan's launches captured from a stream, replayed with one
/// launch.
pub struct CudaGraph {
    exec: cu::CUgraphExec,
    ctx: Arc<Context>,
}

// SAFETY: an executable graph may be launched from any thread with its context bound.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures what `record` queues on `stream` (relaxed mode: other threads' CUDA calls
    /// are not affected) and instantiates it.
    ///
    /// # Safety
    /// `stream` must be a live stream of `ctx` that nothing else uses meanwhile; the
    /// addresses `record` queues work on must stay valid for every later launch.
    pub unsafe fn capture(
        ctx: &Arc<Context>,
        stream: cu::CUstream,
        record: impl FnOnce() -> Result<()>,
    ) -> Result<CudaGraph> {
        // SAFETY: a live stream of `ctx` that nothing else uses (this function's contract).
        cu_check(
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    stream,
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
                )
            },
            "cuStreamBeginCapture",
        )?;
        let recorded = record();
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream whose capture began above; a valid out-pointer.
        let ended = cu_check(
            unsafe { cu::cuStreamEndCapture(stream, &mut graph) },
            "cuStreamEndCapture",
        );
        let result = recorded.and(ended).and_then(|()| {
            let mut exec: cu::CUgraphExec = std::ptr::null_mut();
            // SAFETY: the graph just captured; a valid out-pointer.
            cu_check(
                unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
                "cuGraphInstantiateWithFlags",
            )
            .map(|()| CudaGraph {
                exec,
                ctx: ctx.clone(),
            })
        });
        if !graph.is_null() {
            // SAFETY: captured above, destroyed once (the executable graph is separate).
            unsafe { cu::cuGraphDestroy(graph) };
        }
        result
    }

    /// Queues the whole graph on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the graph's context.
    pub unsafe fn launch(&self, stream: cu::CUstream) -> Result<()> {
        // SAFETY: an instantiated graph; a live stream of its context (this function's
        // contract).
        cu_check(
            unsafe { cu::cuGraphLaunch(self.exec, stream) },
            "cuGraphLaunch",
        )
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let _bound = super::driver::ScopedBind::for_cleanup(&self.ctx);
        // SAFETY: instantiated once, destroyed once.
        unsafe { cu::cuGraphExecDestroy(self.exec) };
    }
}
