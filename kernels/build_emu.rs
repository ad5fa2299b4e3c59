pub fn build(_a: &std::path::Path, _b: &[(std::path::PathBuf, Vec<String>)], _c: &std::path::Path) {
}
