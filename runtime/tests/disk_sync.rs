//! The disk publication path and crash-safe checkpoint writes: a poller hot-reloads each new
//! version bit for bit and never loads a partial file (a leftover temp file, a pointer naming a
//! file that is short, damaged or missing), and a writer process killed mid-write leaves the
//! previous file whole and loadable.
//!
//! The kill tests run this test binary again as a child writer (the ignored test
//! `child_writer`, selected by an environment variable) and SIGKILL it while its temp file
//! exists, i.e. between creating the temp file and renaming it.

use sluice_kernels::Backend;
use sluice_model::checkpoint;
use sluice_model::{Arena, Model, ModelConfig};
use sluice_runtime::sync::disk::{weights_file_name, POINTER_FILE};
use sluice_runtime::sync::{ContentHash, DiskError, DiskPoller, DiskPublisher};
use sluice_runtime::trajectory::WeightVersion;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "SLUICE_TEST_CHILD_WRITER";

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-disk-sync-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A model of about 1.7 M parameters (7 MB of f32): big enough that a write takes a while.
fn writer_config() -> ModelConfig {
    let mut cfg = ModelConfig::small();
    cfg.n_layers = 2;
    cfg
}

/// Fills every view of `params` with values that identify `version` (each value depends on
/// it and on its offset). Padding between views, which checkpoints do not store, stays 0.
fn set_version_values(params: &mut Arena, version: u64) {
    for (spec, view) in params.views_mut().unwrap() {
        for (j, v) in view.iter_mut().enumerate() {
            let i = (spec.offset + j) as u64;
            *v = ((i * 2_654_435_761 + version * 97) % 10_007) as f32 / 10_007.0 - 0.5
                + version as f32;
        }
    }
}

fn bits(a: &Arena) -> Vec<u32> {
    a.as_slice().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn tiny() -> Model {
    Model::new(ModelConfig::tiny(), &Backend::Cpu).unwrap()
}

#[test]
fn hot_reload_installs_each_new_version_bit_for_bit() {
    let dir = scratch("reload");
    let mut m = tiny();
    let mut publisher = DiskPublisher::new(&dir, 2).unwrap();
    let mut poller = DiskPoller::new(&dir);
    assert!(
        poller.poll(&Backend::Cpu).unwrap().is_none(),
        "nothing published yet"
    );
    for version in 1..=4u64 {
        set_version_values(&mut m.params, version);
        let published = publisher
            .publish(WeightVersion(version), &m.config, &m.params)
            .unwrap();
        assert_eq!(
            published.bytes,
            std::fs::metadata(&published.path).unwrap().len()
        );
        let update = poller.poll(&Backend::Cpu).unwrap().expect("a new version");
        assert_eq!(update.version, WeightVersion(version));
        assert!(
            bits(&update.params) == bits(&m.params),
            "{}",
            update.version
        );
        assert_eq!(update.config, m.config);
        assert_eq!(update.hash, published.hash);
        assert!(
            poller.poll(&Backend::Cpu).unwrap().is_none(),
            "no newer version"
        );
        assert_eq!(poller.installed(), Some(WeightVersion(version)));
    }
    // Only the last two files are kept, and no temp file is left.
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            "weights-v3.safetensors".to_string(),
            "weights-v4.safetensors".into(),
            POINTER_FILE.into()
        ]
    );
    let s = poller.stats();
    assert_eq!((s.polls, s.loads, s.refused), (9, 4, 0));
    let err = publisher
        .publish(WeightVersion(4), &m.config, &m.params)
        .unwrap_err();
    assert!(matches!(err, DiskError::NotNewer { .. }), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn partial_or_damaged_files_are_never_loaded() {
    let dir = scratch("partial");
    let mut m = tiny();
    let mut publisher = DiskPublisher::new(&dir, 3).unwrap();
    let mut poller = DiskPoller::new(&dir);
    set_version_values(&mut m.params, 2);
    publisher
        .publish(WeightVersion(2), &m.config, &m.params)
        .unwrap();
    let v2_bits = bits(&m.params);
    assert_eq!(
        poller.poll(&Backend::Cpu).unwrap().unwrap().version,
        WeightVersion(2)
    );

    // The complete bytes v3 would have, to build partial and damaged copies from.
    set_version_values(&mut m.params, 3);
    let v3_bytes = checkpoint::to_bytes_with_meta(
        &m.config,
        &m.params,
        &[],
        &[("weight_version", "3".to_string())],
    )
    .unwrap();
    let v3_bits = bits(&m.params);
    let v3_path = dir.join(weights_file_name(WeightVersion(3)));

    // A writer killed mid-write leaves half a temp file; the pointer still names v2.
    std::fs::write(
        checkpoint::temp_path(&v3_path),
        &v3_bytes[..v3_bytes.len() / 2],
    )
    .unwrap();
    assert!(poller.poll(&Backend::Cpu).unwrap().is_none());
    let mut fresh = DiskPoller::new(&dir);
    let loaded = fresh.poll(&Backend::Cpu).unwrap().unwrap();
    assert_eq!(loaded.version, WeightVersion(2));
    assert!(bits(&loaded.params) == v2_bits);

    // A broken writer moves the pointer before the file is whole: the file is missing, then
    // short, then full length with a wrong byte. Each poll refuses it; v2 stays installed.
    let pointer = serde_json::json!({
        "format": "sluice-weights-pointer",
        "version": 3,
        "file": weights_file_name(WeightVersion(3)),
        "bytes": v3_bytes.len(),
        "blake3": ContentHash::of(&v3_bytes).to_hex(),
    })
    .to_string();
    std::fs::write(dir.join(POINTER_FILE), pointer).unwrap();
    let mut damaged = v3_bytes.clone();
    damaged[v3_bytes.len() - 3] ^= 0x40;
    for (what, contents) in [
        ("missing", None),
        ("short", Some(&v3_bytes[..v3_bytes.len() - 100])),
        ("damaged", Some(&damaged[..])),
    ] {
        if let Some(c) = contents {
            std::fs::write(&v3_path, c).unwrap();
        }
        let err = poller.poll(&Backend::Cpu).unwrap_err();
        assert!(matches!(err, DiskError::Incomplete { .. }), "{what}: {err}");
        assert!(err.to_string().contains("weights-v3"), "{what}: {err}");
        assert_eq!(poller.installed(), Some(WeightVersion(2)), "{what}");
    }
    // The writer finishes: the next poll loads v3 bit for bit.
    std::fs::write(&v3_path, &v3_bytes).unwrap();
    let loaded = poller.poll(&Backend::Cpu).unwrap().unwrap();
    assert_eq!(loaded.version, WeightVersion(3));
    assert!(bits(&loaded.params) == v3_bits);
    assert_eq!(poller.stats().refused, 3);

    // A pointer that is not a pointer is an error naming it, and changes nothing.
    std::fs::write(dir.join(POINTER_FILE), "{\"version\": 9").unwrap();
    let err = poller.poll(&Backend::Cpu).unwrap_err();
    assert!(matches!(err, DiskError::Pointer { .. }), "{err}");
    assert_eq!(poller.installed(), Some(WeightVersion(3)));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_leftover_temp_file_does_not_hide_the_previous_checkpoint() {
    let dir = scratch("ckpt-leftover");
    let path = dir.join("model.safetensors");
    let mut m = tiny();
    set_version_values(&mut m.params, 1);
    m.save(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    // A killed save left a partial temp file behind.
    std::fs::write(checkpoint::temp_path(&path), &before[..before.len() / 3]).unwrap();
    let loaded = Model::from_checkpoint(&path, &Backend::Cpu).unwrap();
    assert!(bits(&loaded.params) == bits(&m.params));
    // The next save overwrites the leftover and leaves no temp file.
    set_version_values(&mut m.params, 2);
    m.save(&path).unwrap();
    assert!(!checkpoint::temp_path(&path).exists());
    let loaded = Model::from_checkpoint(&path, &Backend::Cpu).unwrap();
    assert!(bits(&loaded.params) == bits(&m.params));
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs `child_writer` in a new process with `mode`, waits for its first complete write
/// (`ready` exists), then SIGKILLs it as soon as `mid_write()` says a temp file exists. Returns
/// whether one was still there after the kill (the kill landed between create and rename).
/// The child writes forever, so a temp file appears again and again: a check that misses one
/// window (this process descheduled on a loaded machine) sees the next.
fn kill_mid_write(mode: &str, ready: &Path, mid_write: &dyn Fn() -> bool) -> bool {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_writer", "--ignored", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the child never wrote {ready:?}");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child writer exited"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    while !mid_write() {
        assert!(
            Instant::now() < deadline,
            "no temp file of the child's writes seen in 60 s"
        );
        std::hint::spin_loop();
    }
    child.kill().unwrap();
    child.wait().unwrap();
    mid_write()
}

/// Whether `dir` holds a temp file (`checkpoint::temp_path` of any file: weights or pointer).
fn any_temp_in(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
}

#[test]
fn a_checkpoint_writer_killed_mid_write_leaves_the_previous_file_whole() {
    let dir = scratch("ckpt-kill");
    let path = dir.join("model.safetensors");
    let cfg = writer_config();
    let mut m = Model::new(cfg.clone(), &Backend::Cpu).unwrap();
    let expected: Vec<Vec<u32>> = (0..2)
        .map(|v| {
            set_version_values(&mut m.params, v);
            bits(&m.params)
        })
        .collect();
    let mut caught = 0;
    for attempt in 0..10 {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(checkpoint::temp_path(&path));
        // The child saves version 0 and 1 alternately, forever.
        let mode = format!("ckpt:{}", path.display());
        let temp = checkpoint::temp_path(&path);
        let mid_write = kill_mid_write(&mode, &path, &|| temp.exists());
        let loaded = Model::from_checkpoint(&path, &Backend::Cpu)
            .unwrap_or_else(|e| panic!("attempt {attempt}: the checkpoint does not load: {e}"));
        let got = bits(&loaded.params);
        assert!(
            expected.contains(&got),
            "attempt {attempt}: the checkpoint is neither whole version"
        );
        caught += mid_write as usize;
        if caught >= 2 {
            break;
        }
    }
    assert!(caught >= 1, "no kill landed while a temp file existed");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_disk_publisher_killed_mid_write_leaves_a_loadable_version() {
    let dir = scratch("publish-kill");
    let mut caught = 0;
    for attempt in 0..10 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // The child publishes versions 1, 2, 3, ... until killed; once the pointer exists, the
        // kill waits for a temp file of a weights file or of the pointer.
        let mode = format!("disk:{}", dir.display());
        let ready = dir.join(POINTER_FILE);
        let mid_write = kill_mid_write(&mode, &ready, &|| any_temp_in(&dir));
        let mut poller = DiskPoller::new(&dir);
        let update = poller
            .poll(&Backend::Cpu)
            .unwrap_or_else(|e| panic!("attempt {attempt}: {e}"))
            .expect("a version");
        // Whatever version the pointer names, its values are exactly that version's.
        let mut m = Model::new(writer_config(), &Backend::Cpu).unwrap();
        set_version_values(&mut m.params, update.version.0);
        assert!(bits(&update.params) == bits(&m.params), "attempt {attempt}");
        assert!(update.version.0 >= 1, "{}", update.version);
        caught += mid_write as usize;
        if caught >= 2 {
            break;
        }
    }
    assert!(caught >= 1, "no kill landed while a temp file existed");
    std::fs::remove_dir_all(&dir).ok();
}

/// Not a test on its own: the writer process of the two kill tests above, selected by
/// `SLUICE_TEST_CHILD_WRITER` (`ckpt:PATH` saves versions 0 and 1 alternately to PATH;
/// `disk:DIR` publishes versions 1, 2, ... into DIR). It loops until killed.
#[test]
#[ignore = "run by the kill tests as a child process"]
fn child_writer() {
    let Ok(mode) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut m = Model::new(writer_config(), &Backend::Cpu).unwrap();
    if let Some(path) = mode.strip_prefix("ckpt:") {
        for v in (0..2).cycle() {
            set_version_values(&mut m.params, v);
            m.save(Path::new(path)).unwrap();
        }
    } else if let Some(dir) = mode.strip_prefix("disk:") {
        let mut publisher = DiskPublisher::new(Path::new(dir), 2).unwrap();
        for v in 1.. {
            set_version_values(&mut m.params, v);
            publisher
                .publish(WeightVersion(v), &m.config, &m.params)
                .unwrap();
        }
    }
}
