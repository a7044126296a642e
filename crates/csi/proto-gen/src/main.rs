//! Writes the CSI messages and the client and server stubs for tonic into src/proto/.
use std::path::Path;

fn main() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = here.parent().expect("crates/csi");
    let protoc = protoc_bin_vendored::protoc_bin_path().expect("vendored protoc");
    std::env::set_var("PROTOC", protoc);
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .out_dir(root.join("src/proto"))
        .compile_protos(&[root.join("proto/csi.proto")], &[root.join("proto")])
        .expect("protoc");
}
