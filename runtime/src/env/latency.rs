//! Per-call environment latency (DESIGN 6.4): none, fixed, lognormal or Pareto, the heavy-tailed
//! ones given by their median and 99th percentile so a config reads the way people describe
//! tail latency ("median 50 ms, p99 2 s").

use std::fmt;

/// z of the standard normal's 99th percentile.
const Z99: f64 = 2.326_347_874_040_841;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LatencyModel {
    /// Every call answers at once.
    None,
    Fixed {
        ms: f64,
    },
    /// exp(N(mu, sigma^2)) with mu = ln(median), sigma = (ln(p99) - mu) / z_0.99.
    LogNormal {
        median_ms: f64,
        p99_ms: f64,
    },
    /// Pareto(x_m, alpha) with the given median and p99: alpha = ln(50) / ln(p99 / median),
    /// x_m = median / 2^(1/alpha). Heavier-tailed than the lognormal beyond p99.
    Pareto {
        median_ms: f64,
        p99_ms: f64,
    },
}

/// A latency parameter that cannot describe a distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyError(pub String);

impl fmt::Display for LatencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LatencyError {}

impl LatencyModel {
    /// Checks the parameters: finite, median > 0 and p99 > median for the heavy tails.
    pub fn validate(&self) -> Result<(), LatencyError> {
        match *self {
            LatencyModel::None => Ok(()),
            LatencyModel::Fixed { ms } => {
                if ms.is_finite() && ms >= 0.0 {
                    Ok(())
                } else {
                    Err(LatencyError(format!("fixed latency {ms} ms must be >= 0")))
                }
            }
            LatencyModel::LogNormal { median_ms, p99_ms }
            | LatencyModel::Pareto { median_ms, p99_ms } => {
                if !(median_ms.is_finite() && median_ms > 0.0) {
                    return Err(LatencyError(format!(
                        "median_ms = {median_ms} must be a number > 0"
                    )));
                }
                if !(p99_ms.is_finite() && p99_ms > median_ms) {
                    return Err(LatencyError(format!(
                        "p99_ms = {p99_ms} must be a number above median_ms = {median_ms}"
                    )));
                }
                Ok(())
            }
        }
    }

    /// The latency in milliseconds for a uniform draw `u` in [0, 1) (inverse-CDF sampling: one
    /// number per call, so a call's latency depends only on its own key).
    pub fn sample_ms(&self, u: f64) -> f64 {
        // Keep u inside (0, 1) so neither tail's inverse CDF is infinite.
        let u = u.clamp(1e-12, 1.0 - 1e-12);
        match *self {
            LatencyModel::None => 0.0,
            LatencyModel::Fixed { ms } => ms,
            LatencyModel::LogNormal { median_ms, p99_ms } => {
                let mu = median_ms.ln();
                let sigma = (p99_ms.ln() - mu) / Z99;
                (mu + sigma * inverse_normal_cdf(u)).exp()
            }
            LatencyModel::Pareto { median_ms, p99_ms } => {
                let (x_m, alpha) = pareto_params(median_ms, p99_ms);
                x_m * (1.0 - u).powf(-1.0 / alpha)
            }
        }
    }

    /// The distribution's quantile q (for docs, tests and the report).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.sample_ms(q)
    }
}

fn pareto_params(median: f64, p99: f64) -> (f64, f64) {
    // P(X > x) = (x_m / x)^alpha: median at 1/2, p99 at 1/100, so (p99/median)^alpha = 50.
    let alpha = 50f64.ln() / (p99 / median).ln();
    (median / 2f64.powf(1.0 / alpha), alpha)
}

/// The standard normal's inverse CDF (Acklam's rational approximation, relative error below
/// 1.2e-9: far below what a latency draw needs).
pub fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_tails_hit_their_median_and_p99() {
        for m in [
            LatencyModel::LogNormal {
                median_ms: 50.0,
                p99_ms: 2000.0,
            },
            LatencyModel::Pareto {
                median_ms: 50.0,
                p99_ms: 2000.0,
            },
        ] {
            m.validate().unwrap();
            assert!((m.quantile_ms(0.5) - 50.0).abs() < 1e-6, "{m:?}");
            assert!((m.quantile_ms(0.99) - 2000.0).abs() < 1e-3, "{m:?}");
            // Monotone in u.
            let mut last = 0.0;
            for i in 1..1000 {
                let x = m.sample_ms(i as f64 / 1000.0);
                assert!(x > last, "{m:?} at {i}");
                last = x;
            }
        }
    }

    #[test]
    fn empirical_quantiles_of_many_draws() {
        let m = LatencyModel::LogNormal {
            median_ms: 50.0,
            p99_ms: 2000.0,
        };
        let mut rng = sluice_kernels::testing::Rng::new(4);
        let mut xs: Vec<f64> = (0..20_000).map(|_| m.sample_ms(rng.uniform())).collect();
        xs.sort_by(f64::total_cmp);
        let median = xs[10_000];
        let p99 = xs[19_800];
        assert!((median / 50.0 - 1.0).abs() < 0.05, "median {median}");
        assert!((p99 / 2000.0 - 1.0).abs() < 0.25, "p99 {p99}");
    }

    #[test]
    fn bad_parameters_are_named() {
        let e = LatencyModel::LogNormal {
            median_ms: 50.0,
            p99_ms: 10.0,
        }
        .validate()
        .unwrap_err();
        assert!(e.0.contains("p99_ms"), "{e}");
        let e = LatencyModel::Pareto {
            median_ms: 0.0,
            p99_ms: 10.0,
        }
        .validate()
        .unwrap_err();
        assert!(e.0.contains("median_ms"), "{e}");
        assert!(LatencyModel::Fixed { ms: -1.0 }.validate().is_err());
    }

    #[test]
    fn inverse_normal_cdf_known_values() {
        assert!(inverse_normal_cdf(0.5).abs() < 1e-9);
        assert!((inverse_normal_cdf(0.99) - Z99).abs() < 1e-7);
        assert!((inverse_normal_cdf(0.01) + Z99).abs() < 1e-7);
        assert!((inverse_normal_cdf(0.841_344_746_068_543) - 1.0).abs() < 1e-7);
    }
}
