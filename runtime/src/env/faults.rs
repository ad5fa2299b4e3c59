//! Injected environment faults and the plan of one environment call.
//!
//! Each call's latency and fate are drawn from a stream keyed by (run seed, session, turn,
//! attempt), never from a shared generator, so they do not depend on the order in which calls
//! happen (the virtual clock replays bit for bit, and a wall-clock run draws the same ones).

use super::latency::LatencyModel;
use crate::hash::{hash_str, mix64};
use crate::trajectory::TokenId;
use sluice_kernels::testing::Rng;
use std::fmt;

/// Per-call probabilities of each injected fault, each in [0, 1], summing to at most 1.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct FaultRates {
    /// The environment dies during the call (a sandbox collapse): the call fails after its
    /// latency.
    pub crash: f64,
    /// The call never answers: it fails when the task's timeout expires.
    pub timeout: f64,
    /// The call answers with garbage (token ids outside the vocabulary).
    pub garbage: f64,
}

impl FaultRates {
    pub fn validate(&self) -> Result<(), String> {
        for (name, r) in [
            ("crash", self.crash),
            ("timeout", self.timeout),
            ("garbage", self.garbage),
        ] {
            if !(0.0..=1.0).contains(&r) {
                return Err(format!("faults.{name} = {r} is outside [0, 1]"));
            }
        }
        let sum = self.crash + self.timeout + self.garbage;
        if sum > 1.0 + 1e-12 {
            return Err(format!(
                "faults.crash + faults.timeout + faults.garbage = {sum} exceeds 1"
            ));
        }
        Ok(())
    }

    /// The probability that one call fails in any way (before retries).
    pub fn any(&self) -> f64 {
        self.crash + self.timeout + self.garbage
    }
}

/// How one environment call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallFault {
    Crash,
    Timeout,
    Garbage,
}

impl CallFault {
    pub fn as_str(self) -> &'static str {
        match self {
            CallFault::Crash => "crash",
            CallFault::Timeout => "timeout",
            CallFault::Garbage => "garbage",
        }
    }
}

impl fmt::Display for CallFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one call will do: answer (or fail) after `delay_ms`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CallPlan {
    pub delay_ms: f64,
    /// None: the environment answers normally.
    pub fault: Option<CallFault>,
}

/// Identifies one environment call.
#[derive(Clone, Copy, Debug)]
pub struct CallKey<'a> {
    pub session: &'a str,
    pub turn: u32,
    pub attempt: u32,
}

impl CallKey<'_> {
    fn stream(&self, seed: u64) -> Rng {
        let h = hash_str(seed, self.session);
        Rng::new(mix64(
            h ^ mix64((self.turn as u64) << 32 | self.attempt as u64),
        ))
    }
}

/// Plans one call: a latency drawn from `latency`, then a fault drawn from `faults`. A call
/// whose latency exceeds `timeout_ms`, or an injected timeout, fails as `Timeout` at
/// `timeout_ms`.
pub fn plan_call(
    seed: u64,
    key: CallKey<'_>,
    latency: &LatencyModel,
    faults: &FaultRates,
    timeout_ms: f64,
) -> CallPlan {
    let mut rng = key.stream(seed);
    let delay = latency.sample_ms(rng.uniform());
    let u = rng.uniform();
    let injected = if u < faults.crash {
        Some(CallFault::Crash)
    } else if u < faults.crash + faults.timeout {
        Some(CallFault::Timeout)
    } else if u < faults.any() {
        Some(CallFault::Garbage)
    } else {
        None
    };
    if injected == Some(CallFault::Timeout) || delay > timeout_ms {
        return CallPlan {
            delay_ms: timeout_ms,
            fault: Some(CallFault::Timeout),
        };
    }
    CallPlan {
        delay_ms: delay,
        fault: injected,
    }
}

/// The garbage a faulty environment returns: 1 to 8 token ids at or above the vocabulary size.
pub fn garbage_tokens(seed: u64, key: CallKey<'_>, vocab: usize) -> Vec<TokenId> {
    let mut rng = key.stream(seed ^ 0x6a7b_a9e5);
    let n = 1 + rng.below(8);
    (0..n)
        .map(|_| (vocab + rng.below(1 << 16)).min(u32::MAX as usize) as TokenId)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str, turn: u32, attempt: u32) -> CallKey<'_> {
        CallKey {
            session: s,
            turn,
            attempt,
        }
    }

    #[test]
    fn plans_depend_only_on_their_key() {
        let lat = LatencyModel::LogNormal {
            median_ms: 50.0,
            p99_ms: 2000.0,
        };
        let f = FaultRates {
            crash: 0.2,
            timeout: 0.1,
            garbage: 0.1,
        };
        let a = plan_call(7, key("s1", 0, 0), &lat, &f, 1e9);
        let _ = plan_call(7, key("s2", 0, 0), &lat, &f, 1e9);
        assert_eq!(a, plan_call(7, key("s1", 0, 0), &lat, &f, 1e9));
        assert_ne!(a, plan_call(7, key("s1", 0, 1), &lat, &f, 1e9));
        assert_ne!(a, plan_call(8, key("s1", 0, 0), &lat, &f, 1e9));
    }

    #[test]
    fn fault_frequencies_match_the_rates() {
        let f = FaultRates {
            crash: 0.2,
            timeout: 0.05,
            garbage: 0.1,
        };
        let lat = LatencyModel::Fixed { ms: 1.0 };
        let n = 40_000;
        let mut counts = [0usize; 4];
        for i in 0..n {
            let s = format!("s{i}");
            match plan_call(1, key(&s, 0, 0), &lat, &f, 1e9).fault {
                Some(CallFault::Crash) => counts[0] += 1,
                Some(CallFault::Timeout) => counts[1] += 1,
                Some(CallFault::Garbage) => counts[2] += 1,
                None => counts[3] += 1,
            }
        }
        assert_eq!(counts.iter().sum::<usize>(), n);
        for (c, p) in counts.iter().zip([0.2, 0.05, 0.1, 0.65]) {
            let got = *c as f64 / n as f64;
            let sd = (p * (1.0 - p) / n as f64).sqrt();
            assert!((got - p).abs() < 5.0 * sd, "{got} vs {p}");
        }
    }

    #[test]
    fn slow_calls_time_out_at_the_timeout() {
        let lat = LatencyModel::Fixed { ms: 500.0 };
        let p = plan_call(1, key("s", 0, 0), &lat, &FaultRates::default(), 100.0);
        assert_eq!(p.fault, Some(CallFault::Timeout));
        assert_eq!(p.delay_ms, 100.0);
        let p = plan_call(1, key("s", 0, 0), &lat, &FaultRates::default(), 1000.0);
        assert_eq!(
            p,
            CallPlan {
                delay_ms: 500.0,
                fault: None
            }
        );
    }

    #[test]
    fn garbage_is_outside_the_vocabulary() {
        for i in 0..100 {
            let s = format!("g{i}");
            let g = garbage_tokens(3, key(&s, 1, 0), 64);
            assert!(!g.is_empty() && g.len() <= 8);
            assert!(g.iter().all(|&t| t >= 64));
        }
    }

    #[test]
    fn rates_are_validated() {
        let bad = FaultRates {
            crash: 0.7,
            timeout: 0.5,
            garbage: 0.0,
        };
        assert!(bad.validate().unwrap_err().contains("exceeds 1"));
        let bad = FaultRates {
            crash: -0.1,
            ..FaultRates::default()
        };
        assert!(bad.validate().unwrap_err().contains("faults.crash"));
    }
}
