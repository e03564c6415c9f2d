//! Compiles `proto/model_config.proto` without protoc: protox produces the descriptor set
//! that the config parser loads at run time, and prost-build generates the matching Rust
//! types from that same descriptor set. Everything is written under `OUT_DIR`.

use std::path::PathBuf;

const PROTO_DIR: &str = "proto";
const PROTO_FILE: &str = "model_config.proto";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={PROTO_DIR}/{PROTO_FILE}");

    // The C ABI is versioned by the soname; GNU-style linkers only.
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libinfer.so.0");
    }

    if let Err(e) = compile_proto() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn compile_proto() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut compiler = protox::Compiler::new([PROTO_DIR])?;
    compiler.include_imports(true).include_source_info(false);
    compiler.open_file(PROTO_FILE)?;

    std::fs::write(
        out_dir.join("model_config.fds"),
        compiler.encode_file_descriptor_set(),
    )?;

    prost_build::Config::new()
        .out_dir(&out_dir)
        .btree_map(["."])
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
