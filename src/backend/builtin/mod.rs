//! Small models the library ships for examples, tests and benchmarks, selected with
//! `backend: "identity"`, `backend: "add_sub"` or `backend: "accumulator"` (a stateful
//! running sum for sequence batching). All read the parameter `execute_delay_us`
//! (simulated compute per execution) so batching effects can be measured without a real
//! model.

mod accumulator;
mod add_sub;
mod identity;

use super::Backend;
use crate::config::ModelConfig;
use crate::status::Result;
use std::sync::Arc;

/// The built-in backend called `name`, if there is one.
pub fn lookup(name: &str) -> Option<Arc<dyn Backend>> {
    match name {
        "identity" => Some(Arc::new(identity::Identity)),
        "add_sub" => Some(Arc::new(add_sub::AddSub)),
        "accumulator" => Some(Arc::new(accumulator::Accumulator)),
        _ => None,
    }
}

pub(crate) fn execute_delay_us(config: &ModelConfig) -> Result<u64> {
    Ok(config.parameter_u64("execute_delay_us")?.unwrap_or(0))
}

/// Reads `bytes` as `[T]`, copying only when the buffer is not aligned for `T`.
pub(crate) fn typed<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}
