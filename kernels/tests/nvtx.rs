//! NVTX: a tool library built here from C (the protocol an NVTX tool such as nsys implements:
//! `InitializeInjectionNvtx2` asks for the export tables, checks every module's table, and fills
//! the core module's RangePushA and RangePop slots) receives sluice's ranges, nested and in
//! order; a tool that declines leaves ranges off with the reason. One test in this file, since
//! the first range fixes the process's NVTX status.

use sluice_kernels::nvtx::{self, Status};
use sluice_kernels::Backend;
use std::path::{Path, PathBuf};
use std::process::Command;

const TOOL: &str = r#"
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef void (*fp)(void);
typedef const void *(*get_t)(uint32_t);
typedef struct { size_t size; int (*module)(int, fp ***, unsigned *); } callbacks_t;
typedef struct { size_t size; uint32_t version; uint32_t reserved; void (*set_version)(uint32_t); } version_t;
static void note(const char *what, const char *m) {
    FILE *f = fopen(getenv("FAKE_NVTX_LOG"), "a");
    if (!f) return;
    fprintf(f, "%s%s%s\n", what, m ? " " : "", m ? m : "");
    fclose(f);
}
static int push_a(const char *m) { note("push", m); return 0; }
static int pop(void) { note("pop", NULL); return 0; }
int InitializeInjectionNvtx2(get_t get) {
#ifdef DECLINE
    return 0;
#endif
    const callbacks_t *cb = get(1);
    const version_t *v = get(3);
    if (!cb || cb->size != sizeof(callbacks_t)) { note("bad callbacks table", NULL); return 0; }
    if (!v || v->size != sizeof(version_t) || v->version != 3) { note("bad version table", NULL); return 0; }
    if (get(2) || get(4)) { note("unexpected export table", NULL); return 0; }
    v->set_version(3);
    static const unsigned sizes[7] = {0, 16, 9, 15, 7, 16, 7};
    fp **core = NULL;
    for (int m = 1; m <= 6; m++) {
        fp **t = NULL; unsigned n = 0;
        if (!cb->module(m, &t, &n) || n != sizes[m] || t[0] || t[n]) { note("bad module", NULL); return 0; }
        for (unsigned i = 1; i < n; i++) if (!t[i]) { note("missing slot", NULL); return 0; }
        if (m == 1) core = t;
    }
    fp **t = NULL; unsigned n = 0;
    if (cb->module(7, &t, &n)) { note("module 7 exists", NULL); return 0; }
    *core[9] = (fp)push_a;
    *core[11] = (fp)pop;
    note("init", NULL);
    return 1;
}
"#;

/// Builds the tool with the system C compiler; None (with the reason printed) where there is
/// none.
fn build_tool(dir: &Path, name: &str, defines: &[&str]) -> Option<PathBuf> {
    let src = dir.join("tool.c");
    std::fs::write(&src, TOOL).unwrap();
    let out = dir.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .args(defines)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        Ok(s) => panic!("{cc} failed to build the NVTX test tool: {s}"),
        Err(e) => {
            eprintln!("SKIPPED: no C compiler `{cc}` to build an NVTX tool ({e})");
            None
        }
    }
}

#[test]
fn a_tool_receives_nested_ranges_and_a_declining_tool_leaves_them_off() {
    let dir = std::env::temp_dir().join(format!("sluice-nvtx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some(tool) = build_tool(&dir, "libtool.so", &[]) else {
        return;
    };
    let declining = build_tool(&dir, "libdecline.so", &["-DDECLINE"]).unwrap();
    let log = dir.join("log.txt");
    // Set before the first range in this process (the only test of this binary).
    std::env::set_var("FAKE_NVTX_LOG", &log);

    match nvtx::load(Some(declining.as_os_str())) {
        Status::Inactive(why) => assert!(why.contains("declined"), "{why}"),
        s => panic!("a declining tool: {s:?}"),
    }
    assert!(!log.exists(), "the declining tool wrote {log:?}");

    std::env::set_var("NVTX_INJECTION64_PATH", &tool);
    assert_eq!(
        nvtx::status(),
        &Status::Active(tool.to_string_lossy().into_owned())
    );
    {
        let _outer = nvtx::range("bench gemm forward");
        let _inner = nvtx::range("gemm_bf16_mma");
        // Off cuda no range opens, tool or not.
        let _cpu = nvtx::range_on(&Backend::Cpu, "never");
    }
    let long = "x".repeat(300);
    drop(nvtx::range(&long));
    drop(nvtx::range("cut\0here"));
    let text = std::fs::read_to_string(&log).unwrap();
    let want = format!(
        "init\npush bench gemm forward\npush gemm_bf16_mma\npop\npop\npush {}\npop\npush cut\npop\n",
        "x".repeat(127)
    );
    assert_eq!(text, want);
    std::fs::remove_dir_all(&dir).ok();
}
