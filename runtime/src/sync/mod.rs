//! Weight sync: how the learner's new weights reach the engines (DESIGN 6.6).
//!
//! - [`delta`] and [`chunk`]: the delta codec. A bytewise diff of the image a receiver holds
//!   (version v) against the new one (v + K), cut into chunks, each encoded as positions, gaps,
//!   zstd of the XOR or raw bytes, whichever is smallest; a self-describing header with both
//!   versions and both blake3 hashes; applied by overwriting bytes and checked by hash.
//! - [`publish`]: [`Publisher`] (the learner's side: the images it published, the cheapest
//!   [`Publication`] per receiver) and [`Receiver`] (an engine's side: installs only verified
//!   bytes, or says [`NeedsFullSync`]).
//! - [`disk`]: safetensors checkpoints written atomically plus a pointer file, and a poller that
//!   hot-reloads a new version and never loads a partial file.
//! - [`content_hash`]: blake3 of an image.
//! - [`lane`]: the three paths inside a run (`sync.path`): the learner lane's [`SyncSource`],
//!   each replica lane's [`SyncSink`], and the faults tests inject.
//!
//! The codec, the publisher and the disk files work on byte slices (the f32 parameter arena's
//! bytes today, a bf16 copy later) and know nothing of the engine; [`lane`] wires them to the
//! engine, and docs/runtime.md ("Weight sync") describes it.

pub mod chunk;
pub mod content_hash;
pub mod delta;
pub mod disk;
pub mod lane;
pub mod publish;

pub use chunk::{ElemType, Encoding};
pub use content_hash::ContentHash;
pub use delta::{DeltaError, EncodeParams, EncodingSummary, Image};
pub use disk::{DiskError, DiskPoller, DiskPublication, DiskPublisher, DiskUpdate};
pub use lane::{
    Delivery, Outgoing, StartImage, SyncFault, SyncOptions, SyncPath, SyncReport, SyncSink,
    SyncSource,
};
pub use publish::{
    NeedsFullSync, Payload, Publication, PublishError, Publisher, PublisherStats, Receiver,
    ReceiverStats,
};
