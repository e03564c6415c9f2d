//! The config schema's protobuf types, generated at build time (`build.rs`) from
//! `proto/model_config.proto`: what `parse` reads a config into and `validate` checks.
#![allow(
    clippy::all,
    clippy::pedantic,
    dead_code,
    missing_docs,
    unreachable_pub
)]

include!(concat!(env!("OUT_DIR"), "/inference.rs"));
