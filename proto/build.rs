//! Compiles tether's protos with protox (a pure-Rust protobuf compiler), so
//! building tether never needs `protoc`.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/tether/cni/v1/cni.proto",
        "proto/tether/admin/v1/admin.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The encoded descriptor set feeds gRPC server reflection.
    std::fs::write(out.join("tether_descriptor.bin"), fds.encode_to_vec())?;
    let client = std::env::var_os("CARGO_FEATURE_CLIENT").is_some();
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    tonic_prost_build::configure()
        .build_client(client)
        .build_server(server)
        .build_transport(false)
        .compile_fds(fds)?;
    Ok(())
}
