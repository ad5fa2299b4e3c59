//! What a run leaves for people to look at: SVG charts of its metrics ([`plots`]), drawn by a
//! small dependency-free SVG writer ([`svg`]).

pub mod plots;
pub mod svg;
