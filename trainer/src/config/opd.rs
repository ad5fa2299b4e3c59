//! `[opd]`: on-policy distillation in the RL stages (issue 28 item 6; sluice_runtime::distill),
//! and the contradictions between it and the other switches (item 8), each refused naming both
//! keys.

use super::resolve::Get;
use super::*;
use sluice_kernels::ops::is_gate_loss::KlEstimator;
use sluice_runtime::distill::{OpdConfig, OpdForm};
use sluice_runtime::regularize::KlPlace;

/// One teacher: a checkpoint and the tasks whose trajectories it scores.
#[derive(Clone, Debug, PartialEq)]
pub struct TeacherSection {
    pub checkpoint: PathBuf,
    pub tasks: Vec<String>,
}

/// On-policy distillation (`[opd]` with `form` other than none, or `log`).
#[derive(Clone, Debug, PartialEq)]
pub struct OpdSection {
    /// The form (None: teachers score and the gap is logged, nothing trained on it) and coef.
    pub config: OpdConfig,
    pub teachers: Vec<TeacherSection>,
}

impl OpdSection {
    /// The config key of teacher `i`'s checkpoint (for errors).
    pub fn checkpoint_key(i: usize) -> String {
        format!("opd.teachers[{i}].checkpoint")
    }
}

/// The strings of an array (an error naming `key` otherwise).
fn strings(v: &Value, key: &str) -> Result<Vec<String>, ConfigError> {
    let Value::Array(a) = v else {
        return Err(err(key, "expected an array of strings"));
    };
    a.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| err(&format!("{key}[{i}]"), "expected a string"))
        })
        .collect()
}

/// `opd.teachers`: an array of `{ checkpoint = "PATH", tasks = ["NAME", ...] }`.
fn teachers(opd: &Get<'_>) -> Result<Vec<TeacherSection>, ConfigError> {
    let Value::Array(list) = opd.value("teachers")? else {
        return Err(err("opd.teachers", "expected an array of tables"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let key = format!("opd.teachers[{i}]");
        let Value::Table(t) = t else {
            return Err(err(
                &key,
                "expected a table { checkpoint = \"PATH\", tasks = [\"NAME\", ...] }",
            ));
        };
        if let Some(k) = t
            .keys()
            .find(|k| !matches!(k.as_str(), "checkpoint" | "tasks"))
        {
            return Err(err(
                &format!("{key}.{k}"),
                "unknown key (a teacher has checkpoint and tasks)",
            ));
        }
        let checkpoint = match t.get("checkpoint") {
            Some(Value::String(p)) if !p.is_empty() => PathBuf::from(p),
            Some(Value::String(_)) | None => {
                return Err(err(
                    &format!("{key}.checkpoint"),
                    "missing: a teacher's checkpoint",
                ))
            }
            Some(_) => return Err(err(&format!("{key}.checkpoint"), "expected a string")),
        };
        let tasks_key = format!("{key}.tasks");
        let tasks = match t.get("tasks") {
            Some(v) => strings(v, &tasks_key)?,
            None => return Err(err(&tasks_key, "missing: the tasks the teacher scores")),
        };
        if tasks.is_empty() {
            return Err(err(&tasks_key, "a teacher needs at least one task"));
        }
        out.push(TeacherSection { checkpoint, tasks });
    }
    Ok(out)
}

/// Resolves `[opd]` against the rest of the config (None: off). Every value is checked
/// whether or not distillation is on.
pub(super) fn resolve_opd(
    table: &Table,
    stages: &[StageSection],
    buffer: &BufferSection,
    loss: &LossSection,
) -> Result<Option<OpdSection>, ConfigError> {
    let opd = Get::section(table, "opd")?;
    let estimator = KlEstimator::parse(opd.str("kl_estimator")?).map_err(|_| {
        err(
            "opd.kl_estimator",
            format!(
                "{:?} is not k1 or k3",
                opd.str("kl_estimator").unwrap_or("")
            ),
        )
    })?;
    let with_grpo = opd.bool("with_grpo")?;
    let center = opd.bool("center")?;
    let form = match opd.str("form")? {
        "none" => None,
        "advantage" => Some(OpdForm::Advantage { with_grpo, center }),
        "kl" => Some(OpdForm::Kl(estimator)),
        o => {
            return Err(err(
                "opd.form",
                format!("{o:?} is not none, advantage or kl"),
            ))
        }
    };
    let coef = opd.float("coef", |x| x > 0.0, "> 0")? as f32;
    let log = opd.bool("log")?;
    let list = teachers(&opd)?;
    for (on, key) in [(with_grpo, "opd.with_grpo"), (center, "opd.center")] {
        if on && !matches!(form, Some(OpdForm::Advantage { .. })) {
            return Err(err(
                key,
                "shapes the per-token advantages of opd.form = \"advantage\"; with another form \
                 it does nothing",
            ));
        }
    }
    if form.is_none() && !log {
        if !list.is_empty() {
            return Err(err(
                "opd.teachers",
                "teachers without distillation: set opd.form (advantage or kl) or opd.log = true",
            ));
        }
        return Ok(None);
    }
    let config = OpdConfig { form, coef };
    if form == Some(OpdForm::Kl(KlEstimator::K1)) {
        return Err(err(
            "opd.kl_estimator",
            "k1 with opd.form = \"kl\": k1's gradient in the loss is coef x grad log pi, the \
             same whatever the teacher says, so it distils nothing; use k3, or opd.form = \
             \"advantage\" (the k1 log-ratio as a detached per-token reward)",
        ));
    }
    if list.is_empty() {
        return Err(err(
            "opd.teachers",
            "on-policy distillation needs at least one teacher: [{ checkpoint = \"PATH\", \
             tasks = [\"NAME\"] }]",
        ));
    }
    // Every task of every RL stage scored by exactly one teacher; no teacher of a task no RL
    // stage trains.
    let rl_tasks: Vec<&String> = stages
        .iter()
        .filter(|s| s.kind == StageKind::Rl)
        .flat_map(|s| &s.tasks)
        .collect();
    for (i, t) in list.iter().enumerate() {
        if !t.checkpoint.is_file() {
            return Err(err(
                &OpdSection::checkpoint_key(i),
                format!("no checkpoint file at {}", t.checkpoint.display()),
            ));
        }
        for task in &t.tasks {
            if !rl_tasks.contains(&task) {
                return Err(err(
                    &format!("opd.teachers[{i}].tasks"),
                    format!("task {task:?} is in no RL stage"),
                ));
            }
            if let Some(j) = list[..i].iter().position(|o| o.tasks.contains(task)) {
                return Err(err(
                    &format!("opd.teachers[{i}].tasks"),
                    format!("task {task:?} already has a teacher (opd.teachers[{j}])"),
                ));
            }
            if t.tasks.iter().filter(|x| *x == task).count() > 1 {
                return Err(err(
                    &format!("opd.teachers[{i}].tasks"),
                    format!("names task {task:?} twice"),
                ));
            }
        }
    }
    for (si, s) in stages.iter().enumerate() {
        if s.kind != StageKind::Rl {
            continue;
        }
        if let Some(task) = s
            .tasks
            .iter()
            .find(|n| !list.iter().any(|t| t.tasks.contains(n)))
        {
            return Err(err(
                "opd.teachers",
                format!(
                    "stage[{si}] trains task {task:?}, which no teacher scores (every task of an \
                     RL stage needs one)"
                ),
            ));
        }
    }
    conflicts(&config, buffer, loss)?;
    Ok(Some(OpdSection {
        config,
        teachers: list,
    }))
}

/// The pairs of settings that contradict distillation's form.
fn conflicts(
    opd: &OpdConfig,
    buffer: &BufferSection,
    loss: &LossSection,
) -> Result<(), ConfigError> {
    let pure_advantage = matches!(
        opd.form,
        Some(OpdForm::Advantage {
            with_grpo: false,
            ..
        })
    );
    let kl_coef = loss.kl.map_or(0.0, |k| k.coef);
    let kl_place = loss.kl.map(|k| k.place);
    if matches!(opd.form, Some(OpdForm::Kl(_))) && kl_coef > 0.0 && kl_place == Some(KlPlace::Loss)
    {
        return Err(err(
            "opd.form",
            "\"kl\" together with loss.kl_coef > 0 and loss.kl_in = \"loss\": the loss kernel \
             takes one KL target per token, the teacher's or the reference's; put the \
             reference's KL in the reward (loss.kl_in = \"reward\") or use opd.form = \
             \"advantage\"",
        ));
    }
    if pure_advantage && kl_coef > 0.0 && kl_place == Some(KlPlace::Reward) {
        return Err(err(
            "loss.kl_in",
            "\"reward\" with opd.form = \"advantage\" (without opd.with_grpo): the KL penalty \
             shapes rewards before GRPO's advantages, which the teacher's advantages replace, so \
             it would act nowhere; use loss.kl_in = \"loss\" or opd.with_grpo = true",
        ));
    }
    if pure_advantage && buffer.dynamic_sampling.is_some() {
        return Err(err(
            "buffer.dynamic_sampling",
            "with opd.form = \"advantage\" (without opd.with_grpo) the advantages come from \
             the teacher, not from the group's rewards: dynamic sampling would drop groups \
             that carry the teacher's signal; turn one off, or set opd.with_grpo = true",
        ));
    }
    let with_grpo = matches!(
        opd.form,
        Some(OpdForm::Advantage {
            with_grpo: true,
            ..
        })
    );
    if with_grpo && buffer.group_size < 2 {
        return Err(err(
            "opd.with_grpo",
            format!(
                "adds GRPO's advantage, which is 0 in a group of one (buffer.group_size = {}); \
                 use groups of 2 or more, or opd.with_grpo = false",
                buffer.group_size
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::load;
    use super::*;

    /// A file to stand in for a teacher's checkpoint (the config checks only that it is a file;
    /// its architecture is checked when a run starts: trainer/tests/opd.rs).
    fn teacher_file() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sluice-opd-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("teacher.safetensors");
        std::fs::write(&p, b"stand-in").unwrap();
        p
    }

    /// `opd.teachers` with one teacher of `tasks` at the stand-in file.
    fn teachers(tasks: &str) -> String {
        format!(
            "opd.teachers=[{{ checkpoint = {:?}, tasks = [{tasks}] }}]",
            teacher_file().to_str().unwrap()
        )
    }

    fn both() -> String {
        teachers("\"sort\", \"tool\"")
    }

    fn sets(extra: &[&str]) -> Vec<String> {
        let mut v = vec![both()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    }

    /// The error of `sets`: its key, and that its message names every one of `names`.
    fn refused(sets: &[String], key: &str, names: &[&str]) {
        let e = load(None, sets).unwrap_err();
        assert_eq!(e.key, key, "{sets:?}: {e}");
        for n in names {
            assert!(e.to_string().contains(n), "{sets:?}: {e} does not name {n}");
        }
    }

    #[test]
    fn off_by_default_and_each_form_resolves() {
        let d = load(None, &[]).unwrap();
        assert_eq!(d.opd, None);
        let c = load(None, &sets(&["opd.form=\"advantage\"", "opd.coef=0.5"])).unwrap();
        let o = c.opd.unwrap();
        assert_eq!(
            o.config,
            OpdConfig {
                form: Some(OpdForm::Advantage {
                    with_grpo: false,
                    center: false
                }),
                coef: 0.5
            }
        );
        assert_eq!(o.teachers.len(), 1);
        assert_eq!(o.teachers[0].tasks, ["sort", "tool"]);
        let c = load(None, &sets(&["opd.form=\"kl\""])).unwrap();
        assert_eq!(
            c.opd.unwrap().config.form,
            Some(OpdForm::Kl(KlEstimator::K3))
        );
        let c = load(None, &sets(&["opd.log=true"])).unwrap();
        assert_eq!(c.opd.unwrap().config.form, None, "measured, not trained on");
        // Two teachers, one task each.
        let f = teacher_file();
        let two = format!(
            "opd.teachers=[{{ checkpoint = {f:?}, tasks = [\"sort\"] }}, {{ checkpoint = {f:?}, \
             tasks = [\"tool\"] }}]"
        );
        let c = load(None, &[two, "opd.form=\"kl\"".into()]).unwrap();
        assert_eq!(c.opd.unwrap().teachers.len(), 2);
        // The written config.toml loads back to the same section.
        let c = load(None, &sets(&["opd.form=\"advantage\"", "opd.center=true"])).unwrap();
        let p = teacher_file().with_file_name("config.toml");
        std::fs::write(&p, c.to_toml()).unwrap();
        assert_eq!(load(Some(&p), &[]).unwrap().opd, c.opd);
    }

    #[test]
    fn bad_values_name_their_key() {
        let form = "opd.form=\"advantage\"";
        for (extra, key) in [
            (vec!["opd.form=\"fast\""], "opd.form"),
            (vec![form, "opd.coef=0"], "opd.coef"),
            (vec![form, "opd.coef=-1"], "opd.coef"),
            (vec![form, "opd.kl_estimator=\"k2\""], "opd.kl_estimator"),
            (vec![form, "opd.teachers=[1]"], "opd.teachers[0]"),
            (vec![form, "opd.teachers=[{ tasks = [\"sort\"] }]"], "opd.teachers[0].checkpoint"),
            (vec![form, "opd.teachers=[{ checkpoint = \"x\" }]"], "opd.teachers[0].tasks"),
            (
                vec![form, "opd.teachers=[{ checkpoint = \"x\", tasks = [] }]"],
                "opd.teachers[0].tasks",
            ),
            (
                vec![form, "opd.teachers=[{ checkpoint = \"x\", tasks = [\"sort\"], share = 1 }]"],
                "opd.teachers[0].share",
            ),
            (
                vec![form, "opd.teachers=[{ checkpoint = \"no/such.safetensors\", tasks = [\"sort\", \"tool\"] }]"],
                "opd.teachers[0].checkpoint",
            ),
            // On without a teacher; teachers while off.
            (vec![form, "opd.teachers=[]"], "opd.teachers"),
            (vec![], "opd.teachers"),
        ] {
            let mut s = vec![both()];
            s.extend(extra.iter().map(|x| x.to_string()));
            let e = load(None, &s).unwrap_err();
            assert_eq!(e.key, key, "{extra:?}: {e}");
        }
    }

    #[test]
    fn every_task_of_an_rl_stage_has_exactly_one_teacher() {
        let form = "opd.form=\"advantage\"".to_string();
        // tool has no teacher.
        refused(
            &[teachers("\"sort\""), form.clone()],
            "opd.teachers",
            &["stage[1]", "tool"],
        );
        // A task no RL stage trains.
        refused(
            &[teachers("\"sort\", \"tool\", \"arith\""), form.clone()],
            "opd.teachers[0].tasks",
            &["arith"],
        );
        refused(
            &[teachers("\"sort\", \"tool\", \"sort\""), form.clone()],
            "opd.teachers[0].tasks",
            &["sort"],
        );
        let f = teacher_file();
        let twice = format!(
            "opd.teachers=[{{ checkpoint = {f:?}, tasks = [\"sort\", \"tool\"] }}, {{ checkpoint \
             = {f:?}, tasks = [\"tool\"] }}]"
        );
        refused(
            &[twice, form],
            "opd.teachers[1].tasks",
            &["tool", "opd.teachers[0]"],
        );
    }

    /// Item 8: the contradictions, each refused with both keys named.
    #[test]
    fn contradictions_name_both_keys() {
        let adv = "opd.form=\"advantage\"";
        let kl = "opd.form=\"kl\"";
        for (extra, key, names) in [
            // Dynamic sampling needs groups; with group size 1 in OPD it is refused (the
            // buffer's own rule, whichever form).
            (
                vec![kl, "buffer.group_size=1", "buffer.dynamic_sampling=true"],
                "buffer.dynamic_sampling",
                vec!["buffer.group_size"],
            ),
            // ...and with the teacher's advantages in place of GRPO's it drops groups that
            // carry signal.
            (
                vec![adv, "buffer.dynamic_sampling=true"],
                "buffer.dynamic_sampling",
                vec!["opd.form", "opd.with_grpo"],
            ),
            // The KL to the reference in the loss and OPD's KL form share the kernel's input.
            (
                vec![kl, "loss.kl_coef=0.1"],
                "opd.form",
                vec!["loss.kl_coef", "loss.kl_in"],
            ),
            (
                vec![kl, "opd.kl_estimator=\"k1\""],
                "opd.kl_estimator",
                vec!["opd.form", "k1"],
            ),
            // A reward-shaping KL where the rewards no longer make the advantages.
            (
                vec![adv, "loss.kl_coef=0.1", "loss.kl_in=\"reward\""],
                "loss.kl_in",
                vec!["opd.form"],
            ),
            // GRPO's advantage in a group of one.
            (
                vec![adv, "opd.with_grpo=true", "buffer.group_size=1"],
                "opd.with_grpo",
                vec!["buffer.group_size"],
            ),
            // Options of the advantage form with another.
            (
                vec![kl, "opd.with_grpo=true"],
                "opd.with_grpo",
                vec!["opd.form"],
            ),
            (vec![kl, "opd.center=true"], "opd.center", vec!["opd.form"]),
            // Measuring alone trains nothing without GRPO's groups.
            (
                vec!["opd.log=true", "buffer.group_size=1"],
                "buffer.group_size",
                vec!["opd.form"],
            ),
        ] {
            let owned: Vec<String> = std::iter::once(both())
                .chain(extra.iter().map(|s| s.to_string()))
                .collect();
            refused(&owned, key, &names);
        }
    }

    /// Group size 1 where the teacher's signal needs no group; the compatible switches of
    /// issue 28 together with each form.
    #[test]
    fn groups_of_one_and_compatible_switches_are_accepted() {
        for form in [
            vec!["opd.form=\"advantage\""],
            vec!["opd.form=\"advantage\"", "opd.center=true"],
            vec!["opd.form=\"kl\""],
        ] {
            let mut s = form.clone();
            s.extend(["buffer.group_size=1", "buffer.groups_per_step=64"]);
            let c = load(None, &sets(&s)).unwrap();
            assert_eq!(c.buffer.group_size, 1);
        }
        let compatible = [
            "opd.form=\"advantage\"",
            "opd.with_grpo=true",
            "buffer.dynamic_sampling=true",
            "optim.minibatches=2",
            "optim.epochs=2",
            "loss.four_bounds=true",
            "loss.aggregation=\"prompt\"",
            "loss.mode=\"ppo\"",
            "loss.decoupled=true",
            "loss.entropy_coef=0.01",
            "loss.kl_coef=0.1",
            "run.mode=\"sync\"",
            "rollout.over_sampling=1.5",
            "rollout.partial_rollout=true",
        ];
        load(None, &sets(&compatible)).unwrap();
        // The KL form with the reference's KL in the reward.
        load(
            None,
            &sets(&[
                "opd.form=\"kl\"",
                "loss.kl_coef=0.1",
                "loss.kl_in=\"reward\"",
            ]),
        )
        .unwrap();
    }
}
