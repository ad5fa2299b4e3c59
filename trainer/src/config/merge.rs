//! Merging a config into the defaults: key by key for sections, whole for `[[stage]]`, by name
//! for `[tasks.NAME]` (a new task from the first default task's template), and `--set` parsing;
//! a key the defaults lack or a value of another type is an error naming the key.

use super::*;

pub(super) fn defaults() -> Table {
    // The embedded defaults are part of the program; a syntax error there is a build bug that
    // every test catches.
    DEFAULTS
        .parse::<Table>()
        .unwrap_or_else(|e| panic!("trainer/src/defaults.toml does not parse: {e}"))
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "a string",
        Value::Integer(_) => "an integer",
        Value::Float(_) => "a number",
        Value::Boolean(_) => "true or false",
        Value::Datetime(_) => "a date",
        Value::Array(_) => "an array",
        Value::Table(_) => "a table",
    }
}

/// `got` takes the place of `default` at `key`: same type (an integer for a float is
/// converted); tables and arrays are checked by the caller.
fn conform(key: &str, default: &Value, got: Value) -> Result<Value, ConfigError> {
    match (default, got) {
        (Value::Float(_), Value::Integer(i)) => Ok(Value::Float(i as f64)),
        (d, g) if std::mem::discriminant(d) == std::mem::discriminant(&g) => Ok(g),
        (d, g) => Err(err(
            key,
            format!("expected {}, got {} ({g})", type_name(d), type_name(&g)),
        )),
    }
}

pub(super) fn join(prefix: &str, k: &str) -> String {
    if prefix.is_empty() {
        k.to_string()
    } else {
        format!("{prefix}.{k}")
    }
}

/// Merges `user` into `base` key by key; every key of `user` must exist in `schema`.
fn merge_table(
    prefix: &str,
    base: &mut Table,
    schema: &Table,
    user: Table,
) -> Result<(), ConfigError> {
    for (k, v) in user {
        let key = join(prefix, &k);
        let Some(def) = schema.get(&k) else {
            if key == "rollout.num_blocks" {
                return Err(err(
                    &key,
                    "was replaced by rollout.kv_bytes: the KV pool is sized in bytes (per \
                     replica, every layer's K and V), and holds as many blocks as fit in the \
                     run's precision (a bf16 cache twice as many as an f32 one)",
                ));
            }
            let known: Vec<&str> = schema.keys().map(String::as_str).collect();
            return Err(err(
                &key,
                format!(
                    "unknown key (known keys here: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
        };
        match (def, v) {
            (Value::Table(dt), Value::Table(ut)) => {
                let mut b = match base.remove(&k) {
                    Some(Value::Table(t)) => t,
                    _ => dt.clone(),
                };
                merge_table(&key, &mut b, dt, ut)?;
                base.insert(k, Value::Table(b));
            }
            (Value::Array(da), Value::Array(ua)) => {
                // Arrays of scalars: element type of the default's first element.
                let mut out = Vec::with_capacity(ua.len());
                for (i, x) in ua.into_iter().enumerate() {
                    match da.first() {
                        Some(d) => out.push(conform(&format!("{key}[{i}]"), d, x)?),
                        None => out.push(x),
                    }
                }
                base.insert(k, Value::Array(out));
            }
            (d, v) => {
                let v = conform(&key, d, v)?;
                base.insert(k, v);
            }
        }
    }
    Ok(())
}

/// The task template: the first `[tasks.NAME]` table of the defaults.
fn task_template(defaults: &Table) -> Table {
    match defaults.get("tasks") {
        Some(Value::Table(tasks)) => match tasks.values().next() {
            Some(Value::Table(t)) => {
                let mut t = t.clone();
                // A kind's parameters are not inherited by a new task of another kind.
                for k in [
                    "digits",
                    "min_digits",
                    "tool_fraction",
                    "wrong_call_fraction",
                    "chain_fraction",
                    "chain_call_fraction",
                    "items",
                    "command",
                    "args",
                    "url",
                ] {
                    t.remove(k);
                }
                t
            }
            _ => Table::new(),
        },
        _ => Table::new(),
    }
}

/// A task's optional keys: its kind's parameters (crate::tasks::TaskOptions), absent unless
/// set; each kind rejects the ones it does not take.
fn task_schema(template: &Table) -> Table {
    let mut schema = template.clone();
    for (k, v) in [
        ("digits", Value::Integer(0)),
        ("min_digits", Value::Integer(0)),
        ("tool_fraction", Value::Float(0.0)),
        ("wrong_call_fraction", Value::Float(0.0)),
        ("chain_fraction", Value::Float(0.0)),
        ("chain_call_fraction", Value::Float(0.0)),
        ("items", Value::Integer(0)),
        ("command", Value::String(String::new())),
        ("args", Value::Array(Vec::new())),
        ("url", Value::String(String::new())),
    ] {
        schema.entry(k).or_insert(v);
    }
    schema
}

/// Merges a user (or `--set`) table into the merged config.
pub(super) fn merge_config(
    merged: &mut Table,
    defaults: &Table,
    user: Table,
) -> Result<(), ConfigError> {
    let template = task_template(defaults);
    for (section, v) in user {
        match section.as_str() {
            "stage" => {
                let Value::Array(stages) = v else {
                    return Err(err(
                        "stage",
                        "expected [[stage]] tables (an array of tables)",
                    ));
                };
                let schema = match defaults.get("stage") {
                    Some(Value::Array(a)) => match a.first() {
                        Some(Value::Table(t)) => t.clone(),
                        _ => Table::new(),
                    },
                    _ => Table::new(),
                };
                let mut out = Vec::with_capacity(stages.len());
                for (i, s) in stages.into_iter().enumerate() {
                    let key = format!("stage[{i}]");
                    let Value::Table(t) = s else {
                        return Err(err(&key, "expected a table"));
                    };
                    for required in ["kind", "steps"] {
                        if !t.contains_key(required) {
                            return Err(err(&format!("{key}.{required}"), "missing"));
                        }
                    }
                    let mut base = schema.clone();
                    merge_table(&key, &mut base, &schema, t)?;
                    out.push(Value::Table(base));
                }
                merged.insert("stage".into(), Value::Array(out));
            }
            "tasks" => {
                let Value::Table(tasks) = v else {
                    return Err(err("tasks", "expected [tasks.NAME] tables"));
                };
                let mut all = match merged.remove("tasks") {
                    Some(Value::Table(t)) => t,
                    _ => Table::new(),
                };
                for (name, t) in tasks {
                    let key = format!("tasks.{name}");
                    let Value::Table(t) = t else {
                        return Err(err(&key, "expected a table"));
                    };
                    let mut base = match all.remove(&name) {
                        Some(Value::Table(b)) => b,
                        None => {
                            if !t.contains_key("kind") {
                                return Err(err(
                                    &format!("{key}.kind"),
                                    "missing: a new task needs a kind",
                                ));
                            }
                            template.clone()
                        }
                        Some(_) => template.clone(),
                    };
                    merge_table(&key, &mut base, &task_schema(&template), t)?;
                    all.insert(name, Value::Table(base));
                }
                merged.insert("tasks".into(), Value::Table(all));
            }
            _ => {
                let Some(Value::Table(schema)) = defaults.get(&section) else {
                    let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
                    return Err(err(
                        &section,
                        format!("unknown section (known: {})", known.join(", ")),
                    ));
                };
                let Value::Table(t) = v else {
                    return Err(err(&section, "expected a table"));
                };
                let mut base = match merged.remove(&section) {
                    Some(Value::Table(b)) => b,
                    _ => schema.clone(),
                };
                merge_table(&section, &mut base, schema, t)?;
                merged.insert(section, Value::Table(base));
            }
        }
    }
    Ok(())
}

/// Parses `--set a.b.c=value` into a nested table `{a = {b = {c = value}}}`.
pub(super) fn parse_set(s: &str) -> Result<Table, ConfigError> {
    let Some((path, value)) = s.split_once('=') else {
        return Err(err(
            s,
            "--set takes section.key=value (e.g. --set buffer.tau=4)",
        ));
    };
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(err(path, "--set needs a dotted key such as buffer.tau"));
    }
    if path.starts_with("stage") {
        return Err(err(
            path,
            "stages cannot be set one key at a time; write [[stage]] tables in a config file",
        ));
    }
    let value = value.trim();
    let parsed: Value = match format!("v = {value}").parse::<Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(Value::String(value.to_string())),
        Err(_) => Value::String(value.to_string()),
    };
    let mut keys: Vec<&str> = path.split('.').collect();
    let last = keys.pop().unwrap_or_default();
    let mut table = Table::new();
    table.insert(last.to_string(), parsed);
    for k in keys.into_iter().rev() {
        let mut outer = Table::new();
        outer.insert(k.to_string(), Value::Table(table));
        table = outer;
    }
    Ok(table)
}
