//! The delta codec (runtime/src/sync): every encoding round-trips bit for bit, the chosen one
//! is never larger than any other candidate, chunk boundaries and ragged tails are handled, and
//! a corrupted, truncated or misdirected delta is refused and never installed.

use sluice_kernels::testing::Rng;
use sluice_runtime::sync::chunk::ChunkCodec;
use sluice_runtime::sync::delta::{self, HEADER_LEN, TRAILER_LEN};
use sluice_runtime::sync::{
    ContentHash, DeltaError, ElemType, EncodeParams, Encoding, Image, Payload, Publication,
    PublishError, Publisher, Receiver,
};
use sluice_runtime::trajectory::WeightVersion;
use std::sync::Arc;

/// How the new image differs from the base.
#[derive(Clone, Copy, Debug)]
enum Update {
    Nothing,
    OneByte,
    /// Each byte changed with this probability.
    Sparse(f64),
    /// Every byte replaced by a random one.
    DenseRandom,
    /// An f32 image, every value moved by a relative step of this size (an optimizer step on
    /// the f32 master: nearly every value changes, mostly in its low mantissa bytes).
    F32Step(f32),
    /// The bf16 copies of an f32 image before and after such a step (changes only where the
    /// step crosses a bf16 rounding boundary).
    Bf16Step(f32),
    /// Runs of changed bytes separated by unchanged stretches.
    Runs,
    /// The first and last byte of every chunk.
    ChunkEdges,
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// A byte that differs from `b`.
fn other(rng: &mut Rng, b: u8) -> u8 {
    b ^ (1 + rng.below(255) as u8)
}

fn floats(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * 0.02) as f32).collect()
}

fn step(rng: &mut Rng, vals: &[f32], rel: f32) -> Vec<f32> {
    vals.iter()
        .map(|v| v * (1.0 + rel * rng.normal() as f32))
        .collect()
}

fn f32_bytes(vals: &[f32]) -> Vec<u8> {
    vals.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bf16_bytes(vals: &[f32]) -> Vec<u8> {
    vals.iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect()
}

/// (base, new, element type) of `len` bytes. Float images get a ragged tail of random bytes
/// when `len` is not a multiple of the element width.
fn make_pair(
    rng: &mut Rng,
    len: usize,
    chunk: usize,
    update: Update,
) -> (Vec<u8>, Vec<u8>, ElemType) {
    let base = random_bytes(rng, len);
    let mut new = base.clone();
    let mut elem = [ElemType::U8, ElemType::F32, ElemType::Bf16][rng.below(3)];
    match update {
        Update::Nothing => {}
        Update::OneByte => {
            if len > 0 {
                let p = rng.below(len);
                new[p] = other(rng, new[p]);
            }
        }
        Update::Sparse(density) => {
            for b in new.iter_mut() {
                if rng.uniform() < density {
                    *b = other(rng, *b);
                }
            }
        }
        Update::DenseRandom => {
            for b in new.iter_mut() {
                *b = other(rng, *b);
            }
        }
        Update::F32Step(rel) => {
            elem = ElemType::F32;
            let v = floats(rng, len / 4);
            let w = step(rng, &v, rel);
            let (mut b, mut n) = (f32_bytes(&v), f32_bytes(&w));
            let tail = random_bytes(rng, len % 4);
            b.extend_from_slice(&tail);
            n.extend(tail.iter().map(|&t| t.wrapping_add(1)));
            return (b, n, elem);
        }
        Update::Bf16Step(rel) => {
            elem = ElemType::Bf16;
            let v = floats(rng, len / 2);
            let w = step(rng, &v, rel);
            let (mut b, mut n) = (bf16_bytes(&v), bf16_bytes(&w));
            let tail = random_bytes(rng, len % 2);
            b.extend_from_slice(&tail);
            n.extend_from_slice(&tail);
            return (b, n, elem);
        }
        Update::Runs => {
            let mut p = 0;
            while p < len {
                p += rng.below(300);
                let run = 1 + rng.below(40);
                for b in new.iter_mut().take((p + run).min(len)).skip(p) {
                    *b = other(rng, *b);
                }
                p += run;
            }
        }
        Update::ChunkEdges => {
            let mut start = 0;
            while start < len {
                let end = (start + chunk).min(len);
                new[start] = other(rng, new[start]);
                new[end - 1] = other(rng, new[end - 1]);
                start = end;
            }
        }
    }
    (base, new, elem)
}

/// Checks every candidate of every chunk of (base, new): its payload has the size reported,
/// decodes to the new chunk exactly, and the chosen encoding's payload is the smallest.
/// Returns how many chunks chose each encoding.
fn check_chunks(base: &[u8], new: &[u8], chunk: usize, elem: ElemType) -> [usize; 5] {
    let mut codec = ChunkCodec::new(1).unwrap();
    let mut chosen = [0usize; 5];
    for (i, (b, n)) in base.chunks(chunk).zip(new.chunks(chunk)).enumerate() {
        let sizes = codec.candidate_sizes(elem, b, n);
        assert!(
            sizes[Encoding::Raw.index()].is_some(),
            "raw is always a candidate"
        );
        for e in Encoding::ALL {
            let mut payload = Vec::new();
            let ok = codec.encode_as(e, elem, b, n, &mut payload);
            assert_eq!(ok, sizes[e.index()].is_some(), "chunk {i} {e:?}");
            if !ok {
                continue;
            }
            assert_eq!(
                Some(payload.len()),
                sizes[e.index()],
                "chunk {i} {e:?} size"
            );
            // Poison the output where the encoding overwrites everything (raw), else start from
            // the base chunk as the receiver does.
            let mut out = if e == Encoding::Raw {
                vec![0xA5; b.len()]
            } else {
                b.to_vec()
            };
            codec.decode(e, elem, &payload, &mut out).unwrap();
            assert!(out == n, "chunk {i}: {e:?} does not round-trip");
        }
        let mut payload = Vec::new();
        let e = codec.encode_best(elem, b, n, &mut payload);
        let smallest = sizes.iter().flatten().min().copied().unwrap();
        assert_eq!(
            payload.len(),
            smallest,
            "chunk {i}: chose {e:?} among {sizes:?}"
        );
        assert_eq!(sizes[e.index()], Some(smallest));
        let mut out = b.to_vec();
        codec.decode(e, elem, &payload, &mut out).unwrap();
        assert!(out == n, "chunk {i}: the chosen {e:?} does not round-trip");
        chosen[e.index()] += 1;
    }
    chosen
}

/// The whole-delta path: encode, apply into a poisoned buffer, compare bits and sizes.
fn check_delta(base: &[u8], new: &[u8], params: &EncodeParams) -> delta::Encoded {
    let b = Image::new(WeightVersion(3), base);
    let n = Image::new(WeightVersion(5), new);
    let enc = delta::encode(params, b, n).unwrap();
    assert_eq!(enc.summary.total_bytes(), enc.bytes.len() as u64);
    assert_eq!(enc.summary.full_bytes, new.len() as u64);
    let mut out = vec![0x5A; 3];
    let header = delta::apply(&enc.bytes, b, &mut out).unwrap();
    assert!(out == new, "apply does not reproduce the new image");
    assert_eq!(header.new_version, WeightVersion(5));
    assert_eq!(header.new_hash, ContentHash::of(new));
    assert_eq!(delta::parse(&enc.bytes).unwrap().summary(), enc.summary);
    enc
}

#[test]
fn every_encoding_round_trips_and_the_choice_is_never_larger() {
    let updates = [
        Update::Nothing,
        Update::OneByte,
        Update::Sparse(0.0005),
        Update::Sparse(0.01),
        Update::Sparse(0.2),
        Update::DenseRandom,
        Update::F32Step(1e-3),
        Update::F32Step(1e-6),
        Update::Bf16Step(1e-3),
        Update::Bf16Step(3e-2),
        Update::Runs,
        Update::ChunkEdges,
    ];
    let mut rng = Rng::new(11);
    let mut chosen_total = [0usize; 5];
    let mut cases = 0;
    for (k, &update) in updates.iter().cycle().take(72).enumerate() {
        // Ragged lengths: tiny ones, one less/more than a chunk multiple, and random ones.
        let chunk = [64usize, 136, 1024, 4096][k % 4];
        let len = match k % 6 {
            0 => [1usize, 17, 127][k / 6 % 3],
            1 => chunk * (1 + rng.below(5)) - 1,
            2 => chunk * (1 + rng.below(5)) + 1,
            _ => 1 + rng.below(40_000),
        };
        let (base, new, elem) = make_pair(&mut rng, len, chunk, update);
        let chosen = check_chunks(&base, &new, chunk, elem);
        for (t, c) in chosen_total.iter_mut().zip(chosen) {
            *t += c;
        }
        let params = EncodeParams {
            chunk_size: chunk,
            elem,
            zstd_level: 1,
        };
        let enc = check_delta(&base, &new, &params);
        // The delta's table holds exactly the per-chunk choices checked above.
        let counts: Vec<usize> = enc.summary.chunks.iter().map(|&c| c as usize).collect();
        assert_eq!(counts, chosen, "{update:?} len {len} chunk {chunk}");
        cases += 1;
    }
    assert_eq!(cases, 72);
    // The workload exercises every encoding as a winner but pos32, which beats gap16 only
    // when changed bytes are on average more than 128 KiB apart (larger chunks than these: see
    // the next test).
    for e in Encoding::ALL {
        if e != Encoding::Positions32 {
            assert!(
                chosen_total[e.index()] > 0,
                "{e:?} never chosen: {chosen_total:?}"
            );
        }
    }
}

#[test]
fn gaps_longer_than_a_u16_round_trip_and_positions_win_when_changes_are_far_apart() {
    let mut rng = Rng::new(5);
    let chunk = 1 << 20;
    let len = 4 * chunk + 77;
    let (base, mut new, elem) = make_pair(&mut rng, len, chunk, Update::Nothing);
    // Chunk 0: two changed bytes 300000 and 600000 apart (gap16 needs 4 + 9 escapes, pos32
    // wins). Chunk 1: one every 20000 bytes (no escapes; gap16 wins). Chunks 2 and 3 and the
    // tail: 65535 to 205535 apart (escapes in every gap).
    for p in [300_000, 900_000] {
        new[p] = other(&mut rng, new[p]);
    }
    for p in (chunk + 5..2 * chunk).step_by(20_000) {
        new[p] = other(&mut rng, new[p]);
    }
    let mut p = 2 * chunk + rng.below(100);
    while p < len {
        new[p] = other(&mut rng, new[p]);
        p += 65_535 + rng.below(140_000);
    }
    let chosen = check_chunks(&base, &new, chunk, elem);
    assert!(chosen[Encoding::Positions32.index()] >= 1, "{chosen:?}");
    assert!(chosen[Encoding::Gaps16.index()] >= 1, "{chosen:?}");
    assert_eq!(chosen[Encoding::Raw.index()], 0, "{chosen:?}");
    let params = EncodeParams {
        chunk_size: chunk,
        elem,
        zstd_level: 1,
    };
    check_delta(&base, &new, &params);
}

#[test]
fn empty_and_full_changes() {
    let mut rng = Rng::new(2);
    let chunk = 4096;
    let params = EncodeParams {
        chunk_size: chunk,
        elem: ElemType::U8,
        zstd_level: 1,
    };
    let len = 10 * chunk + 123;
    let n_chunks = 11u64;
    let overhead = (HEADER_LEN + 5 * n_chunks as usize + TRAILER_LEN) as u64;

    // Nothing changed: every chunk `same`, the delta is its header, table and checksum.
    let base = random_bytes(&mut rng, len);
    let enc = check_delta(&base, &base, &params);
    assert_eq!(enc.summary.chunks[Encoding::Same.index()], n_chunks);
    assert_eq!(enc.bytes.len() as u64, overhead);

    // Every byte replaced by random bytes: nothing beats raw (zstd cannot shrink noise,
    // positions cost 3 to 5 bytes per byte), so the delta is the image plus overhead.
    let (base, new, _) = make_pair(&mut rng, len, chunk, Update::DenseRandom);
    let enc = check_delta(&base, &new, &params);
    assert_eq!(enc.summary.chunks[Encoding::Raw.index()], n_chunks);
    assert_eq!(enc.bytes.len() as u64, len as u64 + overhead);

    // An empty image: no chunks.
    let enc = check_delta(&[], &[], &params);
    assert_eq!(enc.bytes.len(), HEADER_LEN + TRAILER_LEN);
}

#[test]
fn bad_parameters_and_mismatched_images_are_errors() {
    let a = vec![1u8; 100];
    let b = vec![2u8; 101];
    let err = delta::encode(
        &EncodeParams::default(),
        Image::new(WeightVersion(0), &a),
        Image::new(WeightVersion(1), &b),
    )
    .unwrap_err();
    assert!(err.to_string().contains("differ in length"), "{err}");
    for chunk_size in [0, 60, 100, 1 << 31] {
        let p = EncodeParams {
            chunk_size,
            ..EncodeParams::default()
        };
        let err = p.validate().unwrap_err();
        assert!(err.to_string().contains("chunk size"), "{err}");
    }
    let p = EncodeParams {
        zstd_level: 99,
        ..EncodeParams::default()
    };
    assert!(p.validate().unwrap_err().to_string().contains("zstd level"));
}

/// A base image (v1), an update (v2) with every kind of chunk, and a receiver holding v1.
fn publisher_and_receiver(rng: &mut Rng) -> (Publisher, Receiver, Vec<u8>) {
    let params = EncodeParams {
        chunk_size: 1024,
        elem: ElemType::F32,
        zstd_level: 1,
    };
    let mut publisher = Publisher::new(params, 2).unwrap();
    let v = floats(rng, 6000);
    let mut w = step(rng, &v, 1e-4);
    // A frozen stretch (same chunks) and a few sparse edits (positional chunks).
    w[2000..3500].copy_from_slice(&v[2000..3500]);
    w[4000..5000].copy_from_slice(&v[4000..5000]);
    for i in (4000..5000).step_by(97) {
        w[i] = -w[i];
    }
    let (v1, v2) = (f32_bytes(&v), f32_bytes(&w));
    publisher.publish(WeightVersion(1), &v1).unwrap();
    let mut receiver = Receiver::new();
    let full = publisher.publication_for(None).unwrap();
    assert!(!full.is_delta());
    receiver.install(&full).unwrap();
    publisher.publish(WeightVersion(2), &v2).unwrap();
    (publisher, receiver, v2)
}

fn with_delta_bytes(p: &Publication, bytes: Vec<u8>) -> Publication {
    let Payload::Delta { base, summary, .. } = &p.payload else {
        panic!("not a delta")
    };
    Publication {
        payload: Payload::Delta {
            base: *base,
            bytes: Arc::from(bytes),
            summary: summary.clone(),
        },
        ..p.clone()
    }
}

/// The receiver refused `p` and still holds v1 bit for bit.
fn assert_refused_and_unchanged(
    receiver: &mut Receiver,
    p: &Publication,
    v1_hash: ContentHash,
) -> DeltaError {
    let before = receiver.bytes().unwrap().to_vec();
    let refused = receiver.stats().refused;
    let err = receiver
        .install(p)
        .expect_err("a bad delta must be refused");
    assert_eq!(err.version, WeightVersion(2));
    assert_eq!(receiver.version(), Some(WeightVersion(1)));
    assert_eq!(receiver.hash(), Some(v1_hash));
    assert!(receiver.bytes().unwrap() == before.as_slice());
    assert_eq!(ContentHash::of(receiver.bytes().unwrap()), v1_hash);
    assert_eq!(receiver.stats().refused, refused + 1);
    err.reason
}

#[test]
fn corrupt_truncated_or_misdirected_deltas_are_refused_then_healed_by_a_full_sync() {
    let mut rng = Rng::new(9);
    let (mut publisher, mut receiver, v2) = publisher_and_receiver(&mut rng);
    let v1_hash = receiver.hash().unwrap();
    let good = publisher.publication_for(receiver.version()).unwrap();
    let Payload::Delta { bytes, summary, .. } = &good.payload else {
        panic!("expected a delta")
    };
    // The update has several kinds of chunk, so the flips below land in several payload kinds.
    let kinds = summary.chunks.iter().filter(|&&c| c > 0).count();
    assert!(kinds >= 3, "{}", summary.label());
    let len = bytes.len();

    // One flipped byte anywhere (header, table, each payload kind, checksum): the checksum.
    let mut flips = vec![
        0,
        9,
        17,
        50,
        100,
        HEADER_LEN + 2,
        len - 1,
        len - TRAILER_LEN - 1,
    ];
    flips.extend((0..20).map(|_| rng.below(len)));
    for at in flips {
        let mut bad = bytes.to_vec();
        bad[at] ^= 0x10;
        let reason =
            assert_refused_and_unchanged(&mut receiver, &with_delta_bytes(&good, bad), v1_hash);
        assert!(
            matches!(reason, DeltaError::Checksum | DeltaError::Malformed(_)),
            "flip at {at}: {reason}"
        );
    }
    // Truncations, down to nothing.
    for keep in [len - 1, len - TRAILER_LEN, len / 2, HEADER_LEN, 7, 0] {
        let bad = bytes[..keep].to_vec();
        let reason =
            assert_refused_and_unchanged(&mut receiver, &with_delta_bytes(&good, bad), v1_hash);
        assert!(
            matches!(reason, DeltaError::Checksum | DeltaError::Malformed(_)),
            "truncated to {keep}: {reason}"
        );
    }
    // A payload byte changed and the checksum recomputed (an encoder bug, or a forger): the
    // result's hash refuses it. Flip inside a raw-free region near the end of the payloads.
    let parsed = delta::parse(bytes).unwrap();
    let target = parsed
        .chunks
        .iter()
        .find(|c| c.encoding == Encoding::ZstdXor)
        .expect("a zstd chunk");
    let mut bad = bytes.to_vec();
    let body = len - TRAILER_LEN;
    // The last byte of a zstd frame is literal data for these updates; changing it changes
    // the output without breaking the frame (or breaks it: either way refused).
    bad[target.payload_offset + target.payload_len - 1] ^= 0x01;
    let sum = ContentHash::of(&bad[..body]);
    bad[body..].copy_from_slice(&sum.0);
    let reason =
        assert_refused_and_unchanged(&mut receiver, &with_delta_bytes(&good, bad), v1_hash);
    assert!(
        matches!(
            reason,
            DeltaError::ResultHash { .. } | DeltaError::Malformed(_)
        ),
        "{reason}"
    );

    // A delta from another base version: v2 -> v3 offered to a receiver on v1.
    let v3 = {
        let mut b = v2.clone();
        b[10] ^= 1;
        b
    };
    let mut p2 = Publisher::new(*publisher.params(), 2).unwrap();
    p2.publish(WeightVersion(2), &v2).unwrap();
    p2.publish(WeightVersion(3), &v3).unwrap();
    let wrong_base = p2.publication_for(Some(WeightVersion(2))).unwrap();
    assert!(wrong_base.is_delta());
    let wrong_base = Publication {
        version: WeightVersion(2),
        ..(*wrong_base).clone()
    };
    let reason = assert_refused_and_unchanged(&mut receiver, &wrong_base, v1_hash);
    assert_eq!(
        reason,
        DeltaError::BaseVersion {
            delta: WeightVersion(2),
            held: Some(WeightVersion(1))
        }
    );

    // Same version number, other bytes: the base hash refuses it.
    let mut impostor = Publisher::new(*publisher.params(), 2).unwrap();
    let mut other_v1 = v2.clone();
    other_v1[0] ^= 0xff;
    impostor.publish(WeightVersion(1), &other_v1).unwrap();
    impostor.publish(WeightVersion(2), &v2).unwrap();
    let misdirected = impostor.publication_for(Some(WeightVersion(1))).unwrap();
    let reason = assert_refused_and_unchanged(&mut receiver, &misdirected, v1_hash);
    assert!(matches!(reason, DeltaError::BaseHash { .. }), "{reason}");

    // A receiver holding nothing cannot take a delta.
    let mut empty = Receiver::new();
    let err = empty.install(&good).unwrap_err();
    assert!(
        matches!(err.reason, DeltaError::BaseVersion { held: None, .. }),
        "{}",
        err.reason
    );
    assert_eq!(empty.version(), None);

    // A full image that does not hash to its publication is refused too.
    let full = publisher.full().unwrap();
    let Payload::Full(fb) = &full.payload else {
        panic!()
    };
    let mut damaged = fb.to_vec();
    damaged[123] ^= 4;
    let bad_full = Publication {
        payload: Payload::Full(Arc::from(damaged)),
        ..(*full).clone()
    };
    let reason = assert_refused_and_unchanged(&mut receiver, &bad_full, v1_hash);
    assert!(matches!(reason, DeltaError::ResultHash { .. }), "{reason}");

    // The good delta still installs, and the heal path (full sync) always works.
    let refused = receiver.stats().refused;
    assert_eq!(receiver.install(&good).unwrap(), v2.as_slice());
    assert_eq!(receiver.hash(), Some(ContentHash::of(&v2)));
    assert_eq!(receiver.stats().delta_installs, 1);
    assert_eq!(receiver.stats().refused, refused);
    let mut fresh = Receiver::new();
    fresh.install(&full).unwrap();
    assert_eq!(fresh.bytes().unwrap(), v2.as_slice());
}

#[test]
fn publisher_serves_each_receiver_a_verified_delta_or_the_full_image() {
    let mut rng = Rng::new(4);
    let params = EncodeParams {
        chunk_size: 4096,
        elem: ElemType::F32,
        zstd_level: 1,
    };
    let mut publisher = Publisher::new(params, 3).unwrap();
    assert_eq!(
        publisher.publication_for(None).unwrap_err(),
        PublishError::NothingPublished
    );
    let mut vals = floats(&mut rng, 20_017);
    let mut receivers: Vec<Receiver> = (0..3).map(|_| Receiver::new()).collect();
    let mut refused = 0;
    for version in 1..=8u64 {
        vals = step(&mut rng, &vals, 1e-3);
        let image = f32_bytes(&vals);
        let hash = publisher.publish(WeightVersion(version), &image).unwrap();
        assert_eq!(hash, ContentHash::of(&image));
        for (r, receiver) in receivers.iter_mut().enumerate() {
            // Receiver 1 misses versions 3 to 6 (it falls out of the retained window); receiver
            // 2 takes every other version (its deltas span two steps).
            if (r == 1 && (3..=6).contains(&version)) || (r == 2 && version % 2 == 0) {
                continue;
            }
            let p = publisher.publication_for(receiver.version()).unwrap();
            if p.is_delta() {
                assert!(p.sync_bytes() < p.full_bytes, "{}", p.sync_encoding());
                assert!(p.sync_encoding().starts_with("delta:"));
            } else {
                assert_eq!(p.sync_encoding(), "full");
                assert_eq!(p.sync_bytes(), image.len() as u64);
            }
            if receiver.install(&p).is_err() {
                refused += 1;
                receiver.install(&publisher.full().unwrap()).unwrap();
            }
            // The weights' hash after every publication is the learner's.
            assert_eq!(receiver.hash(), Some(hash));
            assert!(receiver.bytes().unwrap() == image.as_slice());
            assert_eq!(receiver.version(), Some(WeightVersion(version)));
        }
    }
    assert_eq!(refused, 0);
    let stats: Vec<(u64, u64)> = receivers
        .iter()
        .map(|r| (r.stats().full_installs, r.stats().delta_installs))
        .collect();
    // 0: full at v1, then 7 deltas. 1: full at v1, delta at v2, full at v7 (v2 no longer
    // retained), delta at v8. 2: full at v1, deltas at v3, v5, v7 (two steps each).
    assert_eq!(stats, vec![(1, 7), (2, 2), (1, 3)]);
    let s = publisher.stats();
    assert_eq!(s.published, 8);
    assert_eq!(s.full_publications, 4);
    assert_eq!(s.delta_publications, 12);
    // Receivers on one base share one encoded delta (v2 from v1 for 0 and 1; v8 from v7).
    assert_eq!(s.deltas_encoded, 10);
    assert_eq!(
        publisher.retained(),
        vec![WeightVersion(6), WeightVersion(7), WeightVersion(8)]
    );
    assert_eq!(
        publisher.publish(WeightVersion(8), &[]).unwrap_err(),
        PublishError::NotNewer {
            version: WeightVersion(8),
            latest: WeightVersion(8)
        }
    );
}
