//! The command line as upstream's flag library reads it (urfave/cli v3.6.1, `command_parse.go`,
//! `parseFlags`; upstream `runner/cmd/shim/main.go`), rewritten into one canonical form for
//! clap (`--name=value`, then `--` and the positional arguments), so that every spelling the
//! Go shim takes works here:
//!
//! - a flag takes one dash or two: `-shim-home X`, `-shim-home=X`, `--shim-home X`,
//!   `--shim-home=X`; a one-letter alias too (`-v`, `--v`, `-h`);
//! - a value flag takes the next argument whatever it is (`-shim-home -x`), or what follows
//!   `=`, which must not be empty (`-shim-home=` is an error, as a flag at the end is);
//! - a boolean flag takes no next argument: `-privileged`, `-privileged=false`
//!   (`-privileged false` is the flag and a positional `false`), and `-privileged=` is true;
//! - parsing stops at `--` (what follows is positional), at `-` or an empty argument (what
//!   follows is ignored), and at an argument of a dash and no letter (`-1`: it and what
//!   follows are positional); other arguments are positional (old servers start `dstack-shim
//!   docker …`) and flags may follow them;
//! - the first positional argument `help` or `h` is the help command;
//! - a flag given twice: the last wins; an unknown one is an error (`flag provided but not
//!   defined: -x`), as short options are not combined.
//!
//! The flags come from clap's definition ([`crate::config::Args`]), so there is one list.

use std::ffi::OsString;

/// What is wrong with the command line, in urfave/cli's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgvError {
    /// No such flag.
    #[error("flag provided but not defined: -{0}")]
    Unknown(String),
    /// A value flag without its value.
    #[error("flag needs an argument: {0}")]
    NoValue(String),
    /// `--version=maybe`.
    #[error("invalid value {value:?} for flag -{flag}: parse error")]
    InvalidBool {
        /// The flag as given.
        flag: String,
        /// The value.
        value: String,
    },
    /// An argument that is not UTF-8 (clap would refuse it too).
    #[error("argument {0:?} is not valid UTF-8")]
    NotUtf8(OsString),
}

/// How a flag takes its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Takes a value (`--name value`, `--name=value`).
    Value,
    /// A Go boolean whose value the configuration parses (`--privileged=false` overrides the
    /// environment): passed on as `--name=<value>`, `true` when none is given.
    GoBool,
    /// A switch (`--version`, `--help`): on unless the value is a Go false.
    Switch,
}

/// One flag of the definition.
#[derive(Debug, Clone)]
struct Flag {
    long: String,
    names: Vec<String>,
    kind: Kind,
}

fn flags(command: &clap::Command) -> Vec<Flag> {
    command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?.to_owned();
            let mut names = vec![long.clone()];
            names.extend(
                arg.get_short_and_visible_aliases()
                    .unwrap_or_default()
                    .iter()
                    .map(char::to_string),
            );
            names.extend(
                arg.get_all_aliases()
                    .unwrap_or_default()
                    .iter()
                    .map(|a| (*a).to_owned()),
            );
            let takes_values = arg.get_action().takes_values();
            let optional = arg.get_num_args().is_some_and(|r| r.min_values() == 0);
            let kind = match (takes_values, optional) {
                (false, _) => Kind::Switch,
                (true, true) => Kind::GoBool,
                (true, false) => Kind::Value,
            };
            Some(Flag { long, names, kind })
        })
        .collect()
}

/// Rewrites `args` (the program name first) as clap reads it: the program name, each flag
/// once as `--long=value` with the last value given (a switch as `--long`, or nothing when
/// set false), then `--` and the positional arguments. The help command becomes `--help`.
pub fn normalise(
    args: impl IntoIterator<Item = OsString>,
    command: &clap::Command,
) -> Result<Vec<OsString>, ArgvError> {
    let flags = flags(command);
    let mut args = args.into_iter();
    let mut out: Vec<OsString> = args.next().into_iter().collect();
    let args: Vec<String> = args
        .map(|a| a.into_string().map_err(ArgvError::NotUtf8))
        .collect::<Result<_, _>>()?;
    let mut positional: Vec<String> = Vec::new();
    // Each flag once, in the order first given, with its last value (`None`: a switch set
    // false, left out).
    let mut given: Vec<(String, Option<String>)> = Vec::new();
    let mut set =
        |long: &str, value: Option<String>| match given.iter_mut().find(|(l, _)| l == long) {
            Some(entry) => entry.1 = value,
            None => given.push((long.to_owned(), value)),
        };
    let mut i = 0;
    while i < args.len() {
        let first = args[i].trim();
        i += 1;
        if first.is_empty() {
            break;
        }
        if first == "--" {
            positional.extend(args[i..].iter().cloned());
            break;
        }
        let bytes = first.as_bytes();
        if bytes[0] != b'-' {
            if positional.is_empty() && (first == "help" || first == "h") {
                out.push("--help".into());
                return Ok(out);
            }
            positional.push(first.to_owned());
            continue;
        }
        if bytes.len() == 1 {
            positional.push(first.to_owned());
            break;
        }
        let dashes = if bytes[1] == b'-' {
            2
        } else if !char::from(bytes[1]).is_alphabetic() {
            positional.push(first.to_owned());
            positional.extend(args[i..].iter().cloned());
            break;
        } else {
            1
        };
        let (name, value) = match first[dashes..].split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (&first[dashes..], None),
        };
        let flag = if name == "help" || name == "h" {
            Some(Flag {
                long: "help".to_owned(),
                names: Vec::new(),
                kind: Kind::Switch,
            })
        } else {
            flags
                .iter()
                .find(|f| f.names.iter().any(|n| n == name))
                .cloned()
        };
        let Some(flag) = flag else {
            return Err(ArgvError::Unknown(name.to_owned()));
        };
        let value = value.filter(|v| !v.is_empty());
        match flag.kind {
            Kind::Switch => {
                let value = value.unwrap_or("true");
                match crate::config::goparse::go_bool(value) {
                    Some(true) => set(&flag.long, Some(format!("--{}", flag.long))),
                    Some(false) => set(&flag.long, None),
                    None => {
                        return Err(ArgvError::InvalidBool {
                            flag: name.to_owned(),
                            value: value.to_owned(),
                        });
                    }
                }
            }
            Kind::GoBool => {
                let value = value.unwrap_or("true");
                set(&flag.long, Some(format!("--{}={value}", flag.long)));
            }
            Kind::Value => {
                let value = match value {
                    Some(v) => v.to_owned(),
                    None if first.contains('=') || i >= args.len() => {
                        return Err(ArgvError::NoValue(first.to_owned()));
                    }
                    None => {
                        i += 1;
                        args[i - 1].clone()
                    }
                };
                set(&flag.long, Some(format!("--{}={value}", flag.long)));
            }
        }
    }
    out.extend(
        given
            .into_iter()
            .filter_map(|(_, arg)| arg.map(OsString::from)),
    );
    if !positional.is_empty() {
        out.push("--".into());
        out.extend(positional.into_iter().map(OsString::from));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;
    use crate::config::Args;

    fn norm(args: &[&str]) -> Result<Vec<String>, ArgvError> {
        let args = std::iter::once("dstack-shim")
            .chain(args.iter().copied())
            .map(OsString::from);
        normalise(args, &Args::command()).map(|v| {
            v.into_iter()
                .skip(1)
                .map(|a| a.into_string().unwrap())
                .collect()
        })
    }

    /// What urfave/cli v3.6.1 made of these command lines, with upstream's flags (Go 1.27
    /// running upstream's flag definitions from `runner/cmd/shim/main.go`), as clap is given it.
    #[test]
    fn reads_the_command_line_as_urfave_cli_does() {
        let cases: &[(&[&str], &[&str])] = &[
            (&["-shim-home", "x"], &["--shim-home=x"]),
            (&["-shim-home=x"], &["--shim-home=x"]),
            (&["--shim-home", "x"], &["--shim-home=x"]),
            (&["--shim-home=x"], &["--shim-home=x"]),
            (&["-shim-home", "-x"], &["--shim-home=-x"]),
            (&["-shim-home", " x "], &["--shim-home= x "]),
            (&[" -shim-home", "x"], &["--shim-home=x"]),
            (&["-pass-env=a=b"], &["--pass-env=a=b"]),
            (&["-shim-home", "a", "-shim-home", "b"], &["--shim-home=b"]),
            (&["-v", "-shim-home=a", "-v=false"], &["--shim-home=a"]),
            (
                &["-privileged", "-service", "-privileged=0"],
                &["--privileged=0", "--service=true"],
            ),
            (&["-privileged"], &["--privileged=true"]),
            (&["-privileged=false"], &["--privileged=false"]),
            (&["--privileged="], &["--privileged=true"]),
            (&["-privileged=0"], &["--privileged=0"]),
            (
                &["-privileged", "false"],
                &["--privileged=true", "--", "false"],
            ),
            (&["-service"], &["--service=true"]),
            (&["-v"], &["--version"]),
            (&["--v"], &["--version"]),
            (&["-version"], &["--version"]),
            (&["-version=false"], &[]),
            (&["-h"], &["--help"]),
            (&["-help"], &["--help"]),
            (&["--help"], &["--help"]),
            (&["-h=false"], &[]),
            (&["help"], &["--help"]),
            (&["h", "-shim-home", "x"], &["--help"]),
            (&["docker", "help"], &["--", "docker", "help"]),
            (
                &["docker", "-shim-home", "x"],
                &["--shim-home=x", "--", "docker"],
            ),
            (&["--", "-shim-home", "x"], &["--", "-shim-home", "x"]),
            (&["-", "-shim-home", "x"], &["--", "-"]),
            (&["-1", "-shim-home", "x"], &["--", "-1", "-shim-home", "x"]),
            (&["", "-shim-home", "x"], &[]),
            (&["-shim-http-port", "-5"], &["--shim-http-port=-5"]),
            (&["-shim-http-port", "0x10"], &["--shim-http-port=0x10"]),
            // This shim's own flags take the same syntax.
            (
                &["-unix-socket", "/s", "-fake-gpus=2"],
                &["--unix-socket=/s", "--fake-gpus=2"],
            ),
        ];
        for (args, want) in cases {
            let want: Vec<String> = want.iter().map(|w| (*w).to_owned()).collect();
            assert_eq!(norm(args), Ok(want), "{args:?}");
        }
        let errors: &[(&[&str], &str)] = &[
            (&["-nope"], "flag provided but not defined: -nope"),
            (&["-sx"], "flag provided but not defined: -sx"),
            (
                &["---shim-home", "x"],
                "flag provided but not defined: --shim-home",
            ),
            (
                &["-Shim-home", "x"],
                "flag provided but not defined: -Shim-home",
            ),
            (&["-shim-home="], "flag needs an argument: -shim-home="),
            (&["-shim-home"], "flag needs an argument: -shim-home"),
            (
                &["docker", "-ssh-key", "x"],
                "flag provided but not defined: -ssh-key",
            ),
            (
                &["-privileged=yes"],
                "could not parse \"yes\" as bool value from the command line for flag \
                 privileged: parse error",
            ),
            (
                &["-version=yes"],
                "invalid value \"yes\" for flag -version: parse error",
            ),
        ];
        for (args, want) in errors {
            let got = match norm(args) {
                Err(e) => e.to_string(),
                // A Go boolean's value is judged with the environment's.
                Ok(v) => {
                    let argv = std::iter::once("dstack-shim".to_owned()).chain(v);
                    let parsed = <Args as clap::Parser>::try_parse_from(argv).unwrap();
                    crate::config::Config::resolve(&parsed, &|_| None)
                        .unwrap_err()
                        .to_string()
                }
            };
            assert_eq!(got, *want, "{args:?}");
        }
    }
}
