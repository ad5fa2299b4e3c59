//! Source rewriting for the emulator: what turns a CUDA file into host C++ that the emulator's
//! header can compile. Used by the build (kernels/build_emu.rs, through `#[path]`) for
//! kernels/cuda, and at run time by `sluice emu check` for any file. Pure std, no dependencies.
//!
//! Every rewrite keeps the number of lines, so compiler messages and debug line tables point at
//! the original source (the caller also prepends a `#line 1 "FILE"` directive).

/// Rewrites the shared-memory declarations of a CUDA source (see [`rewrite_extern_shared`] and
/// [`rewrite_static_shared`]).
pub fn rewrite_source(text: &str) -> String {
    rewrite_static_shared(&rewrite_extern_shared(text))
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Rewrites each `extern __shared__ [attrs] T name[];` into
/// `static thread_local T* const name = reinterpret_cast<T*>(::sluice_emu::dynamic_shared_base());`
/// keeping the number of lines. The pointer is per host thread and stable for the thread's life,
/// so the declaration works at block scope and at namespace scope.
pub fn rewrite_extern_shared(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 256);
    let mut rest = text;
    while let Some(pos) = find_extern_shared(rest) {
        out.push_str(&rest[..pos.0]);
        let decl = &rest[pos.0..pos.2];
        match parse_extern_shared(&rest[pos.1..pos.2 - 1]) {
            Some((ty, name)) => {
                out.push_str(&format!(
                    "static thread_local {ty}* const {name} = reinterpret_cast<{ty}*>(::sluice_emu::dynamic_shared_base());"
                ));
                for _ in 0..decl.matches('\n').count() {
                    out.push('\n');
                }
            }
            None => out.push_str(decl),
        }
        rest = &rest[pos.2..];
    }
    out.push_str(rest);
    out
}

/// Finds `extern <ws> __shared__`; returns (start, end of `__shared__`, end after the `;`).
fn find_extern_shared(s: &str) -> Option<(usize, usize, usize)> {
    let mut from = 0;
    while let Some(i) = s[from..].find("extern") {
        let start = from + i;
        from = start + 6;
        let before_ok = start == 0 || !is_ident(s.as_bytes()[start - 1]);
        let after = s[from..].trim_start();
        if before_ok && after.starts_with("__shared__") {
            let sh_end = s.len() - after.len() + "__shared__".len();
            if s.as_bytes().get(sh_end).is_some_and(|&c| is_ident(c)) {
                continue;
            }
            let semi = s[sh_end..].find(';')? + sh_end + 1;
            return Some((start, sh_end, semi));
        }
    }
    None
}

/// Removes `__align__(..)`, `alignas(..)` and `__attribute__((..))` from `decl`; returns the rest
/// and the alignment expressions found.
fn strip_alignment(decl: &str) -> Option<(String, Vec<String>)> {
    let mut d = decl.to_string();
    let mut aligns = Vec::new();
    for attr in ["__align__", "alignas", "__attribute__"] {
        while let Some(i) = find_word(&d, attr) {
            let open = i + d[i..].find('(')?;
            let close = matching_paren(&d, open)?;
            let inner = d[open + 1..close].trim().to_string();
            if attr == "__attribute__" {
                // ((aligned(N))) or ((aligned)): other attributes are dropped.
                let inner = inner.trim_start_matches('(').trim_end_matches(')');
                if let Some(rest) = inner.trim().strip_prefix("aligned") {
                    let n = rest
                        .trim()
                        .trim_start_matches('(')
                        .trim_end_matches(')')
                        .trim();
                    aligns.push(if n.is_empty() {
                        "16".to_string()
                    } else {
                        n.to_string()
                    });
                }
            } else {
                aligns.push(inner);
            }
            d.replace_range(i..=close, " ");
        }
    }
    Some((d, aligns))
}

fn find_word(s: &str, word: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(i) = s[from..].find(word) {
        let at = from + i;
        let end = at + word.len();
        if (at == 0 || !is_ident(b[at - 1])) && !b.get(end).is_some_and(|&c| is_ident(c)) {
            return Some(at);
        }
        from = end;
    }
    None
}

fn matching_paren(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, c) in s[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + k);
                }
            }
            _ => {}
        }
    }
    None
}

/// Parses `[attrs] T name[ ]` (the text between `__shared__` and `;`) into (T, name).
fn parse_extern_shared(decl: &str) -> Option<(String, String)> {
    let (d, _) = strip_alignment(decl)?;
    let d = d.trim();
    let open = d.rfind('[')?;
    if d[open + 1..].trim() != "]" {
        return None;
    }
    let (ty, name) = split_type_name(d[..open].trim_end())?;
    Some((ty, name))
}

/// Splits `T name` at the last identifier.
fn split_type_name(head: &str) -> Option<(String, String)> {
    let name_start = head
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_alphanumeric() || *c == '_')
        .last()?
        .0;
    let name = &head[name_start..];
    let ty = head[..name_start]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if ty.is_empty() || name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
        return None;
    }
    Some((ty, name.to_string()))
}

/// Rewrites each block-scope `[attrs] __shared__ [attrs] T a[dims] [, b[dims] ...];` (no
/// initializer) into references to storage in the emulator's static shared window:
///
/// ```text
/// using a__emu_t = T [dims]; static char a__emu_key;
/// auto& a = ::sluice_emu::static_shared<a__emu_t, ALIGN>(&a__emu_key, "a", __FILE__, __LINE__);
/// ```
///
/// all on the declaration's first line. The emulator lays the variables out with redzones
/// between them, so every access is bounds-checked to the byte, and fills each with 0xFF bytes
/// (NaN) when a block first reaches it. Namespace-scope `__shared__` variables and declarations
/// this parser does not understand are left alone (the header turns them into plain
/// `thread_local`s, not bounds-checked).
pub fn rewrite_static_shared(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 512);
    let mut copied = 0usize;
    // Kinds of the open braces: true = namespace or extern "C" block, false = anything else.
    let mut braces: Vec<bool> = Vec::new();
    let mut stmt_start = 0usize; // start of the current statement (after the last ; { })
    let mut i = 0usize;
    let mut line_start = true;
    while i < b.len() {
        let c = b[i];
        if line_start && c == b'#' {
            // Preprocessor line (with continuations): skip.
            while i < b.len() && !(b[i] == b'\n' && (i == 0 || b[i - 1] != b'\\')) {
                i += 1;
            }
            if text[stmt_start..i.min(text.len())].trim().starts_with('#') {
                stmt_start = i;
            }
            continue;
        }
        if c == b'\n' {
            line_start = true;
            i += 1;
            continue;
        }
        if !c.is_ascii_whitespace() {
            line_start = false;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
            continue;
        }
        let char_literal = c == b'\'' && (i == 0 || !b[i - 1].is_ascii_alphanumeric());
        if c == b'"' || char_literal {
            i += 1;
            while i < b.len() && b[i] != c {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        match c {
            b'{' => {
                let head = strip_comments(&text[stmt_start..i]);
                let head = head.trim();
                let is_ns = head.starts_with("namespace")
                    || head.starts_with("inline namespace")
                    || head == "extern \"C\""
                    || head == "extern \"C++\"";
                braces.push(is_ns);
                stmt_start = i + 1;
            }
            b'}' => {
                braces.pop();
                stmt_start = i + 1;
            }
            b';' => stmt_start = i + 1,
            _ => {}
        }
        if c == b'_'
            && text[i..].starts_with("__shared__")
            && (i == 0 || !is_ident(b[i - 1]))
            && !b.get(i + 10).is_some_and(|&n| is_ident(n))
        {
            let in_function = braces.iter().any(|&ns| !ns);
            if let (true, Some(semi)) = (in_function, text[i..].find(';')) {
                let end = i + semi + 1;
                let start = prefix_start(text, i);
                if let Some(repl) = static_shared_replacement(&text[start..end]) {
                    out.push_str(&text[copied..start]);
                    out.push_str(&repl);
                    copied = end;
                    stmt_start = end;
                    i = end;
                    continue;
                }
            }
            i += 10;
            continue;
        }
        i += 1;
    }
    out.push_str(&text[copied..]);
    out
}

fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    loop {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                out.push_str(&rest[..l]);
                match rest[l..].find('\n') {
                    Some(n) => rest = &rest[l + n..],
                    None => return out,
                }
            }
            (_, Some(bk)) => {
                out.push_str(&rest[..bk]);
                match rest[bk + 2..].find("*/") {
                    Some(e) => rest = &rest[bk + 2 + e + 2..],
                    None => return out,
                }
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// The start of the `__shared__` declaration at `at`: earlier `static` and alignment attributes
/// (`__align__(..)`, `alignas(..)`, `__attribute__((..))`) directly before it belong to it.
fn prefix_start(text: &str, at: usize) -> usize {
    let b = text.as_bytes();
    let mut start = at;
    loop {
        let mut k = start;
        while k > 0 && (b[k - 1] == b' ' || b[k - 1] == b'\t') {
            k -= 1;
        }
        if k == 0 {
            return start;
        }
        if b[k - 1] == b')' {
            // Find the matching '(' backwards, then the attribute name before it.
            let mut depth = 0usize;
            let mut j = k;
            while j > 0 {
                j -= 1;
                match b[j] {
                    b')' => depth += 1,
                    b'(' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    b'\n' | b';' | b'{' | b'}' => return start,
                    _ => {}
                }
            }
            let mut n = j;
            while n > 0 && is_ident(b[n - 1]) {
                n -= 1;
            }
            match &text[n..j] {
                "__align__" | "alignas" | "__attribute__" => start = n,
                _ => return start,
            }
        } else {
            let mut n = k;
            while n > 0 && is_ident(b[n - 1]) {
                n -= 1;
            }
            if &text[n..k] == "static" {
                start = n;
            } else {
                return start;
            }
        }
    }
}

/// The replacement of one static `__shared__` declaration (`decl` runs from its first attribute
/// to the `;`), or None when it is not a plain declaration of variables.
fn static_shared_replacement(decl: &str) -> Option<String> {
    let body = &decl[..decl.len() - 1];
    if body.contains('=') || body.contains('{') || body.contains("//") || body.contains("/*") {
        return None;
    }
    let (rest, aligns) = strip_alignment(body)?;
    let rest = rest.replacen("__shared__", " ", 1);
    let rest = match find_word(&rest, "static") {
        Some(k) => format!("{}{}", &rest[..k], &rest[k + 6..]),
        None => rest,
    };
    // Top-level commas separate declarators.
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut last = 0;
    for (k, c) in rest.char_indices() {
        match c {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&rest[last..k]);
                last = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&rest[last..]);
    let first = parts[0].trim();
    let dims_at = first.find('[').unwrap_or(first.len());
    let (ty, name0) = split_type_name(first[..dims_at].trim_end())?;
    if ty.contains('*') || ty.contains('&') || ty.contains('(') {
        return None;
    }
    // The largest of the alignments written (1: the type's own).
    let mut align = "1".to_string();
    for (k, a) in aligns.iter().enumerate() {
        align = if k == 0 {
            format!("({a})")
        } else {
            format!("(({align}) > ({a}) ? ({align}) : ({a}))")
        };
    }
    let mut decls = vec![(name0, first[dims_at..].trim().to_string())];
    for p in &parts[1..] {
        let p = p.trim();
        let at = p.find('[').unwrap_or(p.len());
        let name = p[..at].trim();
        if name.is_empty() || !name.bytes().all(is_ident) || name.as_bytes()[0].is_ascii_digit() {
            return None;
        }
        decls.push((name.to_string(), p[at..].trim().to_string()));
    }
    let mut out = String::new();
    for (name, dims) in &decls {
        let is_array_dims = dims.starts_with('[') && dims.ends_with(']');
        if !dims.is_empty() && !is_array_dims {
            return None;
        }
        out.push_str(&format!(
            "using {name}__emu_t = {ty} {dims}; static char {name}__emu_key; \
             auto& {name} = ::sluice_emu::static_shared<{name}__emu_t, {align}>(&{name}__emu_key, \"{name}\", __FILE__, __LINE__);"
        ));
        if decls.len() > 1 {
            out.push(' ');
        }
    }
    for _ in 0..decl.matches('\n').count() {
        out.push('\n');
    }
    Some(out)
}

/// Kernel names declared as `extern "C" __global__ void [__launch_bounds__(...)] NAME(`.
pub fn scan_kernel_names(text: &str) -> Vec<String> {
    kernel_declarations(text)
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// Each `extern "C" __global__` kernel with the text of its parameter list (between the
/// parentheses).
pub fn kernel_declarations(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("extern") {
        let mut s = &rest[i + 6..];
        rest = s;
        let mut ok = true;
        for tok in ["\"C\"", "__global__", "void"] {
            let t = s.trim_start();
            if t.len() == s.len() || !t.starts_with(tok) {
                ok = false;
                break;
            }
            s = &t[tok.len()..];
        }
        if !ok {
            continue;
        }
        let mut t = s.trim_start();
        if let Some(lb) = t.strip_prefix("__launch_bounds__") {
            let Some(close) = lb.find(')') else { continue };
            t = lb[close + 1..].trim_start();
        }
        let end = t
            .char_indices()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_'))
            .map_or(t.len(), |(k, _)| k);
        let after = t[end..].trim_start();
        if end > 0 && after.starts_with('(') {
            if let Some(close) = matching_paren(after, 0) {
                found.push((t[..end].to_string(), after[1..close].to_string()));
            }
        }
    }
    found
}

/// One kernel parameter: its type as written (qualifiers and `__restrict__` removed) and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelParam {
    pub ty: String,
    pub name: String,
}

/// Splits a parameter list (as returned by [`kernel_declarations`]) into parameters. Returns
/// None for lists it cannot read (function pointers, default arguments, unnamed parameters).
pub fn parse_params(list: &str) -> Option<Vec<KernelParam>> {
    let list = strip_comments(list);
    let list = list.trim();
    if list.is_empty() || list == "void" {
        return Some(Vec::new());
    }
    let mut params = Vec::new();
    let mut depth = 0i32;
    let mut last = 0;
    let mut pieces = Vec::new();
    for (k, c) in list.char_indices() {
        match c {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                pieces.push(&list[last..k]);
                last = k + 1;
            }
            _ => {}
        }
    }
    pieces.push(&list[last..]);
    for p in pieces {
        if p.contains('(') || p.contains('=') {
            return None;
        }
        let cleaned = p
            .replace("__restrict__", " ")
            .replace("__restrict", " ")
            .replace("__grid_constant__", " ");
        let (ty, name) = split_type_name(cleaned.trim())?;
        let ty = ty.replace(" *", "*").replace("* ", "*");
        params.push(KernelParam { ty, name });
    }
    Some(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_shared_becomes_a_reference_on_the_same_line() {
        let src = "__global__ void k() {\n  __shared__ float tile[32][33];\n  tile[0][0] = 1;\n}\n";
        let out = rewrite_static_shared(src);
        assert_eq!(out.lines().count(), src.lines().count());
        let line = out.lines().nth(1).unwrap();
        assert!(
            line.contains("using tile__emu_t = float [32][33];"),
            "{line}"
        );
        assert!(
            line.contains(
                "auto& tile = ::sluice_emu::static_shared<tile__emu_t, 1>(&tile__emu_key, \"tile\""
            ),
            "{line}"
        );
    }

    #[test]
    fn alignment_before_and_after_shared_and_several_declarators() {
        let src = "void f() {\n    __align__(16) __shared__ __nv_bfloat16 as[2][8], bs[2][8];\n}\n";
        let out = rewrite_static_shared(src);
        let line = out.lines().nth(1).unwrap();
        assert!(
            line.contains("using as__emu_t = __nv_bfloat16 [2][8];"),
            "{line}"
        );
        assert!(
            line.contains("using bs__emu_t = __nv_bfloat16 [2][8];"),
            "{line}"
        );
        assert!(line.contains("static_shared<bs__emu_t, (16)>"), "{line}");
        assert!(!line.contains("__align__"), "{line}");
        let src = "void f() { __shared__ alignas(8) int flag; }";
        let out = rewrite_static_shared(src);
        assert!(out.contains("using flag__emu_t = int ;"), "{out}");
        assert!(out.contains("static_shared<flag__emu_t, (8)>"), "{out}");
    }

    #[test]
    fn namespace_scope_and_extern_shared_are_left_alone() {
        let src = "namespace n { __shared__ float g[4]; }\n";
        assert_eq!(rewrite_static_shared(src), src);
        let src = "void f() { extern __shared__ __align__(16) float dyn[]; }";
        let out = rewrite_source(src);
        assert!(
            out.contains("static thread_local float* const dyn = reinterpret_cast<float*>(::sluice_emu::dynamic_shared_base());"),
            "{out}"
        );
    }

    #[test]
    fn kernel_parameters_are_read_with_their_names() {
        let src = "extern \"C\" __global__ void __launch_bounds__(256) k(const float* __restrict__ x,\n float *out, int n) {}";
        let decls = kernel_declarations(src);
        assert_eq!(decls.len(), 1);
        assert_eq!(decls[0].0, "k");
        let params = parse_params(&decls[0].1).unwrap();
        let got: Vec<(&str, &str)> = params
            .iter()
            .map(|p| (p.ty.as_str(), p.name.as_str()))
            .collect();
        assert_eq!(
            got,
            [("const float*", "x"), ("float*", "out"), ("int", "n")]
        );
        assert_eq!(scan_kernel_names(src), ["k"]);
    }
}
