//! The tool of the tool task: a small integer calculator.
//!
//! Grammar (spaces ignored):
//!
//! ```text
//! expr   := term (('+' | '-') term)*
//! term   := factor (('*' | '/' | '%') factor)*
//! factor := '-' factor | number | '(' expr ')'
//! number := digit+                      (at most 18 digits)
//! ```
//!
//! Arithmetic is on i64 with every operation checked: overflow, division by zero and nesting
//! deeper than [`MAX_DEPTH`] are errors, never a panic or a wrapped result. `/` truncates
//! toward zero and `%` takes the sign of the dividend (Rust's `i64` semantics). Every error's
//! message is lower-case ASCII that the tokenizer can encode, because it goes back to the model
//! as an observation.

use std::fmt;

/// Parentheses and unary minus nest at most this deep (bounds the recursion).
pub const MAX_DEPTH: usize = 32;
/// A program is at most this many characters long.
pub const MAX_LEN: usize = 256;
/// The longest number literal (so that it fits an i64).
const MAX_DIGITS: usize = 18;

/// Why a program has no value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CalcError {
    Empty,
    TooLong(usize),
    /// Unexpected character or end, at a char index (`None`: the end of the program).
    Syntax(Option<usize>),
    NumberTooLong(usize),
    DivisionByZero,
    Overflow,
    TooDeep,
    /// A program of more than one operation, where one operation per call is allowed
    /// ([`eval_one_operation`]).
    OneOperation,
}

impl fmt::Display for CalcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CalcError::Empty => f.write_str("error: empty program"),
            CalcError::TooLong(n) => write!(f, "error: program of {n} chars is too long"),
            CalcError::Syntax(Some(at)) => write!(f, "error: syntax at {at}"),
            CalcError::Syntax(None) => f.write_str("error: unexpected end"),
            CalcError::NumberTooLong(at) => write!(f, "error: number too long at {at}"),
            CalcError::DivisionByZero => f.write_str("error: division by zero"),
            CalcError::Overflow => f.write_str("error: overflow"),
            CalcError::TooDeep => f.write_str("error: nested too deep"),
            CalcError::OneOperation => f.write_str("error: one operation per call"),
        }
    }
}

impl std::error::Error for CalcError {}

/// Evaluates `program` (see the module docs).
pub fn eval(program: &str) -> Result<i64, CalcError> {
    // Count before collecting, so a huge program costs no allocation.
    let len = program.chars().filter(|c| *c != ' ').count();
    if len == 0 {
        return Err(CalcError::Empty);
    }
    if len > MAX_LEN {
        return Err(CalcError::TooLong(len));
    }
    let chars: Vec<char> = program.chars().filter(|c| *c != ' ').collect();
    let mut p = Parser { chars, at: 0 };
    let v = p.expr(0)?;
    match p.peek() {
        None => Ok(v),
        Some(_) => Err(CalcError::Syntax(Some(p.at))),
    }
}

/// Evaluates a program of exactly one operation, `X op Y` (two unsigned numbers, op one of
/// `+ - * / %`, spaces ignored). A program the full grammar accepts but that holds more (or
/// no) operations, such as `2*3*4`, `(2*3)` or `7`, is [`CalcError::OneOperation`]; anything
/// else fails as [`eval`] says (syntax, overflow, division by zero). The tool task's
/// calculator for chained problems: a product of three numbers then takes two calls.
pub fn eval_one_operation(program: &str) -> Result<i64, CalcError> {
    let v = eval(program)?;
    let chars: Vec<char> = program.chars().filter(|c| *c != ' ').collect();
    let ops = chars.iter().filter(|c| "+-*/%".contains(**c)).count();
    let digits_or_op = chars
        .iter()
        .all(|c| c.is_ascii_digit() || "+-*/%".contains(*c));
    // One operator between two numbers: not first (a sign), not last (eval would have failed).
    let one = ops == 1 && digits_or_op && chars.first().is_some_and(char::is_ascii_digit);
    if one {
        Ok(v)
    } else {
        Err(CalcError::OneOperation)
    }
}

/// Recursive descent over the program's characters (spaces removed; positions count those).
struct Parser {
    chars: Vec<char>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn unexpected(&self) -> CalcError {
        CalcError::Syntax(self.peek().map(|_| self.at))
    }

    fn expr(&mut self, depth: usize) -> Result<i64, CalcError> {
        let mut v = self.term(depth)?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.at += 1;
            let r = self.term(depth)?;
            v = if op == '+' {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or(CalcError::Overflow)?;
        }
        Ok(v)
    }

    fn term(&mut self, depth: usize) -> Result<i64, CalcError> {
        let mut v = self.factor(depth)?;
        while let Some(op @ ('*' | '/' | '%')) = self.peek() {
            self.at += 1;
            let r = self.factor(depth)?;
            if op != '*' && r == 0 {
                return Err(CalcError::DivisionByZero);
            }
            v = match op {
                '*' => v.checked_mul(r),
                '/' => v.checked_div(r),
                _ => v.checked_rem(r),
            }
            .ok_or(CalcError::Overflow)?;
        }
        Ok(v)
    }

    fn factor(&mut self, depth: usize) -> Result<i64, CalcError> {
        if depth >= MAX_DEPTH {
            return Err(CalcError::TooDeep);
        }
        match self.peek() {
            Some('-') => {
                self.at += 1;
                let v = self.factor(depth + 1)?;
                v.checked_neg().ok_or(CalcError::Overflow)
            }
            Some('(') => {
                self.at += 1;
                let v = self.expr(depth + 1)?;
                if self.peek() != Some(')') {
                    return Err(self.unexpected());
                }
                self.at += 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() => self.number(),
            _ => Err(self.unexpected()),
        }
    }

    fn number(&mut self) -> Result<i64, CalcError> {
        let start = self.at;
        let mut v: i64 = 0;
        while let Some(d) = self.peek().and_then(|c| c.to_digit(10)) {
            if self.at - start == MAX_DIGITS {
                return Err(CalcError::NumberTooLong(start));
            }
            // 18 digits never overflow an i64.
            v = v * 10 + d as i64;
            self.at += 1;
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_signs_and_parentheses() {
        assert_eq!(eval("123*456"), Ok(56088));
        assert_eq!(eval(" 2 + 3 * 4 "), Ok(14));
        assert_eq!(eval("(2+3)*4"), Ok(20));
        assert_eq!(eval("10-4-3"), Ok(3));
        assert_eq!(eval("-7/2"), Ok(-3));
        assert_eq!(eval("-7%3"), Ok(-1));
        assert_eq!(eval("--5"), Ok(5));
        assert_eq!(eval("007"), Ok(7));
    }

    #[test]
    fn errors_are_values_not_panics() {
        assert_eq!(eval(""), Err(CalcError::Empty));
        assert_eq!(eval("   "), Err(CalcError::Empty));
        assert_eq!(eval("1+"), Err(CalcError::Syntax(None)));
        assert_eq!(eval("1+*2"), Err(CalcError::Syntax(Some(2))));
        assert_eq!(eval("(1+2"), Err(CalcError::Syntax(None)));
        assert_eq!(eval("1)"), Err(CalcError::Syntax(Some(1))));
        assert_eq!(eval("2x"), Err(CalcError::Syntax(Some(1))));
        assert_eq!(eval("5/0"), Err(CalcError::DivisionByZero));
        assert_eq!(eval("5%(1-1)"), Err(CalcError::DivisionByZero));
        assert_eq!(eval("999999999999999999*10"), Err(CalcError::Overflow));
        assert_eq!(
            eval("1234567890123456789"),
            Err(CalcError::NumberTooLong(0))
        );
        let deep = format!("{}1{}", "(".repeat(40), ")".repeat(40));
        assert_eq!(eval(&deep), Err(CalcError::TooDeep));
        assert_eq!(eval(&"-".repeat(100)), Err(CalcError::TooDeep));
        assert_eq!(eval(&"1+".repeat(200)), Err(CalcError::TooLong(400)));
        // i64::MIN / -1 overflows rather than trapping.
        let min = "(-922337203685477580*10-8)";
        assert_eq!(eval(min), Ok(i64::MIN));
        assert_eq!(eval(&format!("{min}/-1")), Err(CalcError::Overflow));
        assert_eq!(eval(&format!("-{min}")), Err(CalcError::Overflow));
    }

    #[test]
    fn one_operation_takes_two_numbers_and_one_operator() {
        assert_eq!(eval_one_operation("37*52"), Ok(1924));
        assert_eq!(eval_one_operation(" 1924 * 8 "), Ok(15392));
        assert_eq!(eval_one_operation("9-12"), Ok(-3));
        assert_eq!(eval_one_operation("17/5"), Ok(3));
        assert_eq!(eval_one_operation("17%5"), Ok(2));
        assert_eq!(eval_one_operation("0+0"), Ok(0));
        // Valid expressions of more or fewer operations, signs or parentheses are refused.
        for p in [
            "2*3*4", "2*3+4", "(2*3)", "(2)*3", "7", "-2*3", "2*-3", "--5", "2*(3)",
        ] {
            assert!(eval(p).is_ok(), "{p}");
            assert_eq!(eval_one_operation(p), Err(CalcError::OneOperation), "{p}");
        }
        // What the full grammar refuses keeps its own error.
        assert_eq!(eval_one_operation(""), Err(CalcError::Empty));
        assert_eq!(eval_one_operation("2*"), Err(CalcError::Syntax(None)));
        assert_eq!(eval_one_operation("2x3"), Err(CalcError::Syntax(Some(1))));
        assert_eq!(eval_one_operation("5/0"), Err(CalcError::DivisionByZero));
        assert_eq!(
            eval_one_operation("999999999999999999*10"),
            Err(CalcError::Overflow)
        );
        assert_eq!(
            CalcError::OneOperation.to_string(),
            "error: one operation per call"
        );
    }
}
