//! Generates the gRPC client and server code of torchft's two services from Rust
//! descriptions (tonic-build's `manual` builder: no protoc, no .proto file to parse). The
//! messages are written by hand in `src/proto.rs`, field for field from torchft's
//! `proto/torchft.proto`; the routes here (`/torchft.LighthouseService/Quorum`, ...) are the
//! other half of that contract.

use tonic_build::manual::{Builder, Method, Service};

fn method(name: &str, route: &str, input: &str, output: &str) -> Method {
    Method::builder()
        .name(name)
        .route_name(route)
        .input_type(format!("crate::proto::{input}"))
        .output_type(format!("crate::proto::{output}"))
        .codec_path("tonic::codec::ProstCodec")
        .build()
}

fn main() {
    let lighthouse = Service::builder()
        .name("LighthouseService")
        .package("torchft")
        .method(method(
            "quorum",
            "Quorum",
            "LighthouseQuorumRequest",
            "LighthouseQuorumResponse",
        ))
        .method(method(
            "heartbeat",
            "Heartbeat",
            "LighthouseHeartbeatRequest",
            "LighthouseHeartbeatResponse",
        ))
        .build();
    let manager = Service::builder()
        .name("ManagerService")
        .package("torchft")
        .method(method(
            "quorum",
            "Quorum",
            "ManagerQuorumRequest",
            "ManagerQuorumResponse",
        ))
        .method(method(
            "checkpoint_metadata",
            "CheckpointMetadata",
            "CheckpointMetadataRequest",
            "CheckpointMetadataResponse",
        ))
        .method(method(
            "should_commit",
            "ShouldCommit",
            "ShouldCommitRequest",
            "ShouldCommitResponse",
        ))
        .method(method("kill", "Kill", "KillRequest", "KillResponse"))
        .build();
    Builder::new().compile(&[lighthouse, manager]);
    println!("cargo:rerun-if-changed=build.rs");
}
