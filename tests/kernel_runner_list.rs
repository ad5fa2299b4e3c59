//! The docs match `sluice kernel --list`: README.md names every runner op and their count.

#[test]
fn readme_names_every_runner_op_and_their_count() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let ops = sluice_kernels::runner::ops();
    assert!(
        readme.contains(&format!("The {} ops:", ops.len())),
        "README.md should say `The {} ops:`",
        ops.len()
    );
    for op in ops {
        assert!(
            readme.contains(&format!("`{}`", op.name)),
            "README.md does not name the runner op `{}`",
            op.name
        );
    }
    // Every op has a runner test file that runs it by name.
    let tests: String = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/tests"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("kernel_runner_") && n != "kernel_runner_list.rs")
        })
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    for op in ops {
        assert!(
            tests.contains(&format!("\"{}\"", op.name)),
            "no tests/kernel_runner_*.rs runs `{}`",
            op.name
        );
    }
}
