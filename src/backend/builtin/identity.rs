//! `identity`: output i is a copy of input i (same datatype and shape).

use crate::backend::{simulate_compute, Backend, Batch, ModelInstance};
use crate::config::ModelConfig;
use crate::status::{Error, Result};
use std::sync::Arc;

pub struct Identity;

struct IdentityInstance {
    /// (input name, output name) pairs.
    pairs: Vec<(Arc<str>, Arc<str>)>,
    delay_us: u64,
}

impl Backend for Identity {
    fn create_instance(
        self: Arc<Self>,
        config: &Arc<ModelConfig>,
        _index: u32,
        _gpu: i32,
    ) -> Result<Box<dyn ModelInstance>> {
        if config.outputs.len() > config.inputs.len() {
            return Err(Error::invalid(format!(
                "model '{}': the identity backend needs an input for each output ({} outputs, {} inputs)",
                config.name,
                config.outputs.len(),
                config.inputs.len()
            )));
        }
        let mut pairs = Vec::new();
        for (i, o) in config.inputs.iter().zip(&config.outputs) {
            if i.data_type != o.data_type {
                return Err(Error::invalid(format!(
                    "model '{}': the identity backend copies input '{}' ({}) to output '{}' ({}): datatypes differ",
                    config.name,
                    i.name,
                    i.data_type.as_str(),
                    o.name,
                    o.data_type.as_str()
                )));
            }
            pairs.push((i.name.clone(), o.name.clone()));
        }
        Ok(Box::new(IdentityInstance {
            pairs,
            delay_us: super::execute_delay_us(config)?,
        }))
    }
}

impl ModelInstance for IdentityInstance {
    fn execute(&mut self, batch: &mut Batch) -> Result<()> {
        simulate_compute(self.delay_us);
        for (input, output) in &self.pairs {
            let Some(idx) = batch.inputs.iter().position(|i| i.name == *input) else {
                continue; // optional input not given: no output either
            };
            batch.copy_input_to_output(idx, output)?;
        }
        Ok(())
    }
}
