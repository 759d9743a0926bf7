//! The recording fake runner (`cfg(test)` or feature `test-support`, like every fake of the
//! workspace).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;

use crate::cmd::{Command, CommandError, CommandOutput, CommandRunner};

/// A queued answer: program, optional first argument, output or spawn error.
type Scripted = (String, Option<String>, Result<CommandOutput, String>);

/// A scripted runner for tests: answers each call with the first queued answer whose program
/// (and, when given, first argument) matches, else with the program's standing answer
/// ([`ScriptedCommandRunner::always`]), else fails to start it; records every call.
#[derive(Debug, Default)]
pub struct ScriptedCommandRunner {
    queued: Mutex<VecDeque<Scripted>>,
    standing: Mutex<Vec<(String, CommandOutput)>>,
    calls: Mutex<Vec<Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ScriptedCommandRunner {
    /// An empty script: every call fails to start its program.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues one answer for `program`.
    pub fn push(&self, program: &str, out: CommandOutput) -> &Self {
        lock(&self.queued).push_back((program.to_owned(), None, Ok(out)));
        self
    }

    /// Queues one answer for `program` whose first argument is `arg0`.
    pub fn push_with_arg(&self, program: &str, arg0: &str, out: CommandOutput) -> &Self {
        lock(&self.queued).push_back((program.to_owned(), Some(arg0.to_owned()), Ok(out)));
        self
    }

    /// Queues a failure to start `program` ([`CommandError::Spawn`], saying `why`).
    pub fn push_spawn_error(&self, program: &str, why: &str) -> &Self {
        lock(&self.queued).push_back((program.to_owned(), None, Err(why.to_owned())));
        self
    }

    /// Answers every call of `program` (once the queue has none for it) with `out`.
    pub fn always(&self, program: &str, out: CommandOutput) -> &Self {
        lock(&self.standing).push((program.to_owned(), out));
        self
    }

    /// Every call so far: the program, then the arguments.
    pub fn calls(&self) -> Vec<Vec<String>> {
        lock(&self.calls).clone()
    }

    /// How many calls of `program` were made.
    pub fn count(&self, program: &str) -> usize {
        lock(&self.calls)
            .iter()
            .filter(|c| c.first().is_some_and(|p| p == program))
            .count()
    }
}

#[async_trait]
impl CommandRunner for ScriptedCommandRunner {
    async fn run(&self, command: &Command) -> Result<CommandOutput, CommandError> {
        let program = command.get_program();
        let args = command.get_args();
        lock(&self.calls).push(
            std::iter::once(program.display().to_string())
                .chain(args.iter().cloned())
                .collect(),
        );
        let is = |p: &str| Path::new(p) == program;
        let found = {
            let mut queue = lock(&self.queued);
            let pos = queue.iter().position(|(p, a, _)| {
                is(p)
                    && a.as_deref()
                        .is_none_or(|a| args.first().map(String::as_str) == Some(a))
            });
            pos.and_then(|i| queue.remove(i))
        };
        match found {
            Some((_, _, Ok(out))) => Ok(out),
            Some((_, _, Err(why))) => Err(spawn_error(program, &why)),
            None => lock(&self.standing)
                .iter()
                .find(|(p, _)| is(p))
                .map(|(_, out)| out.clone())
                .ok_or_else(|| spawn_error(program, "no scripted answer")),
        }
    }
}

fn spawn_error(program: &Path, why: &str) -> CommandError {
    CommandError::Spawn {
        program: program.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, why.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_in_order_then_standing_and_records() {
        let r = ScriptedCommandRunner::new();
        r.push("a", CommandOutput::ok("1"))
            .push_with_arg("a", "-x", CommandOutput::ok("x"))
            .push("a", CommandOutput::ok("2"))
            .always("a", CommandOutput::exit(1, "e"));
        let a = Command::new("a");
        assert_eq!(r.run(&a).await.unwrap().stdout, "1");
        assert_eq!(r.run(&a).await.unwrap().stdout, "2");
        assert_eq!(r.run(&a.clone().arg("-x")).await.unwrap().stdout, "x");
        assert_eq!(r.run(&a).await.unwrap().code(), Some(1));
        r.push_spawn_error("b", "gone");
        let e = r.run(&Command::new("b")).await.unwrap_err();
        assert_eq!(crate::error_chain(&e), "cannot run b: gone");
        assert!(r.run(&Command::new("b")).await.is_err());
        assert_eq!(r.count("a"), 4);
        assert_eq!(r.calls()[2], ["a", "-x"]);
    }
}
