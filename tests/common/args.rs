//! Command-line options of the benches (`cargo bench --bench NAME -- --option value`). A value
//! that does not parse ends the bench with a message naming the option, instead of silently
//! becoming the default; sizes take human units (`256MiB`).

#![allow(dead_code)]

use std::str::FromStr;

pub struct Args(Vec<String>);

impl Args {
    pub fn new() -> Self {
        Self(std::env::args().collect())
    }

    /// The value after `name`, if the option is given.
    pub fn text(&self, name: &str) -> Option<String> {
        let i = self.0.iter().position(|a| a == name)?;
        match self.0.get(i + 1) {
            Some(v) => Some(v.clone()),
            None => fail(name, "needs a value"),
        }
    }

    /// Every value given for a repeatable option, in order.
    pub fn all(&self, name: &str) -> Vec<String> {
        let mut v = Vec::new();
        let mut it = self.0.iter();
        while let Some(a) = it.next() {
            if a == name {
                match it.next() {
                    Some(x) => v.push(x.clone()),
                    None => fail(name, "needs a value"),
                }
            }
        }
        v
    }

    pub fn flag(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }

    /// A number (or anything `FromStr`), `default` when the option is absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> T
    where
        T::Err: std::fmt::Display,
    {
        self.text(name).map_or(default, |v| {
            v.parse()
                .unwrap_or_else(|e| fail(name, &format!("{v:?}: {e}")))
        })
    }

    /// A byte size such as `256MiB` or `4096`.
    pub fn size(&self, name: &str, default: u64) -> u64 {
        self.text(name).map_or(default, |v| {
            wanopt_units::parse_size(&v).unwrap_or_else(|e| fail(name, &e))
        })
    }

    /// One of `choices`, `default` when absent.
    pub fn choice(&self, name: &str, choices: &[&str], default: &str) -> String {
        let v = self.text(name).unwrap_or_else(|| default.to_string());
        if !choices.contains(&v.as_str()) {
            fail(name, &format!("{v:?} is not one of {}", choices.join(", ")));
        }
        v
    }
}

fn fail(name: &str, why: &str) -> ! {
    eprintln!("{name}: {why}");
    std::process::exit(2)
}
