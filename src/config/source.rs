//! The config file as read once: its text, and toml's own spans to say where a key is.
//!
//! [`SourceFile::read`] reads the file and parses it with toml's span-keeping parser
//! ([`toml::de::DeTable`]); a syntax error becomes [`ConfigError::Syntax`] with the line and
//! column toml reports and the key being written there. [`SourceFile::locate`] turns a dotted
//! key (`users[0].permissions[1].vhost`) into the `line:column` of its value (or of the key,
//! for an unknown key), so that errors found after parsing (wrong type, unknown key,
//! validation) point into the file too.

use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::ConfigError;

/// The name used for a syntax error outside any table and key.
const TOP_LEVEL: &str = "(top level)";

/// A config file's path and text, read once and syntax-checked.
#[derive(Debug)]
pub(super) struct SourceFile {
    pub path: PathBuf,
    pub text: String,
}

/// Which span of a key [`SourceFile::locate`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Point {
    /// Where the key is written (an unknown key).
    Key,
    /// Where its value starts (a wrong type, an invalid value).
    Value,
}

impl SourceFile {
    /// Reads the file and checks its TOML syntax.
    pub fn read(path: &Path) -> Result<SourceFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Unreadable {
            path: path.to_path_buf(),
            reason: error.to_string(),
        })?;
        let file = SourceFile {
            path: path.to_path_buf(),
            text,
        };
        file.check_syntax()?;
        Ok(file)
    }

    fn check_syntax(&self) -> Result<(), ConfigError> {
        let (table, errors) = DeTable::parse_recoverable(&self.text);
        let Some(error) = errors.first() else {
            return Ok(());
        };
        let offset = error.span().map(|span| span.start).unwrap_or(0);
        let (line, column) = line_and_column(&self.text, offset);
        Err(ConfigError::Syntax {
            path: self.path.clone(),
            line,
            column,
            key: key_before(table.get_ref(), &self.text, offset),
            message: error.message().trim().replace('\n', "; "),
        })
    }

    /// `path:line:column` of `key` in the file, or of the closest enclosing key written there;
    /// `None` if not even the first segment is in the file.
    pub fn locate(&self, key: &str, point: Point) -> Option<String> {
        let (table, _) = DeTable::parse_recoverable(&self.text);
        let span = find(table.get_ref(), &segments(key), point)?;
        let (line, column) = line_and_column(&self.text, span.start);
        Some(format!("{}:{line}:{column}", self.path.display()))
    }
}

/// One step of a dotted key: a table key or an array index.
#[derive(Debug, PartialEq, Eq)]
enum Segment<'k> {
    Key(&'k str),
    Index(usize),
}

/// `users[0].name` → `users`, `0`, `name`. A key name that itself holds a dot cannot be told
/// from two segments; no setting has one, and such a key is then located at the closest
/// enclosing key found.
fn segments(key: &str) -> Vec<Segment<'_>> {
    let mut out = Vec::new();
    for part in key.split('.') {
        let mut pieces = part.split('[');
        if let Some(name) = pieces.next().filter(|name| !name.is_empty()) {
            out.push(Segment::Key(name));
        }
        for index in pieces {
            match index.trim_end_matches(']').parse() {
                Ok(index) => out.push(Segment::Index(index)),
                Err(_) => return out,
            }
        }
    }
    out
}

/// The span of the deepest segment of `path` found in `table`.
fn find(table: &DeTable<'_>, path: &[Segment<'_>], point: Point) -> Option<Range<usize>> {
    let (Segment::Key(first), rest) = path.split_first()? else {
        return None;
    };
    let (key, value) = table.iter().find(|(key, _)| key.get_ref() == first)?;
    let here = if rest.is_empty() && point == Point::Key {
        key.span()
    } else {
        value.span()
    };
    Some(find_in(value, rest, point).unwrap_or(here))
}

fn find_in(
    value: &Spanned<DeValue<'_>>,
    path: &[Segment<'_>],
    point: Point,
) -> Option<Range<usize>> {
    match (value.get_ref(), path.first()?) {
        (DeValue::Table(table), Segment::Key(_)) => find(table, path, point),
        (DeValue::Array(array), Segment::Index(index)) => {
            let item = array.get(*index)?;
            Some(find_in(item, &path[1..], point).unwrap_or(item.span()))
        }
        _ => None,
    }
}

/// The key being written at `offset`: the last key that starts before it on the same line,
/// else the table that holds the line (`(top level)` outside any).
fn key_before(table: &DeTable<'_>, text: &str, offset: usize) -> String {
    let mut keys = Vec::new();
    collect_keys(table, "", &mut keys);
    let line_start = text
        .get(..offset.min(text.len()))
        .and_then(|before| before.rfind('\n'))
        .map(|newline| newline + 1)
        .unwrap_or(0);
    let Some((start, name, is_table)) = keys
        .into_iter()
        .filter(|(start, _, _)| *start <= offset)
        .max_by_key(|(start, _, _)| *start)
    else {
        return TOP_LEVEL.to_string();
    };
    if start >= line_start || is_table {
        return name;
    }
    match name.rsplit_once('.') {
        Some((parent, _)) => parent.to_string(),
        None => TOP_LEVEL.to_string(),
    }
}

/// Every key of `table` with the start of its key span, its dotted name and whether its value
/// is a table.
fn collect_keys(table: &DeTable<'_>, prefix: &str, out: &mut Vec<(usize, String, bool)>) {
    // Keys the parser made up while recovering from an error have no text.
    for (key, value) in table.iter().filter(|(key, _)| !key.span().is_empty()) {
        let name = if prefix.is_empty() {
            key.get_ref().to_string()
        } else {
            format!("{prefix}.{}", key.get_ref())
        };
        match value.get_ref() {
            DeValue::Table(inner) => {
                out.push((key.span().start, name.clone(), true));
                collect_keys(inner, &name, out);
            }
            DeValue::Array(array) => {
                out.push((key.span().start, name.clone(), false));
                for (index, item) in array.iter().enumerate() {
                    if let DeValue::Table(inner) = item.get_ref() {
                        let element = format!("{name}[{index}]");
                        out.push((item.span().start, element.clone(), true));
                        collect_keys(inner, &element, out);
                    }
                }
            }
            _ => out.push((key.span().start, name, false)),
        }
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> SourceFile {
        SourceFile {
            path: PathBuf::from("c.toml"),
            text: text.to_string(),
        }
    }

    #[test]
    fn keys_are_located_at_their_value_or_key() {
        let text = "mode = \"proxy\"\n[listen]\namqp = \"x\"\n\n[[users]]\nname = \"a\"\n\
                    [[users]]\nname = \"b\"\n[[users.permissions]]\nvhost = \"v\"\n";
        let f = file(text);
        assert_eq!(f.locate("mode", Point::Value).unwrap(), "c.toml:1:8");
        assert_eq!(f.locate("listen.amqp", Point::Value).unwrap(), "c.toml:3:8");
        assert_eq!(f.locate("listen.amqp", Point::Key).unwrap(), "c.toml:3:1");
        assert_eq!(
            f.locate("users[1].name", Point::Value).unwrap(),
            "c.toml:8:8"
        );
        assert_eq!(
            f.locate("users[1].permissions[0].vhost", Point::Value)
                .unwrap(),
            "c.toml:10:9"
        );
        // A key not written falls back to the closest enclosing one that is.
        assert!(f.locate("listen.admin", Point::Value).is_some());
        assert_eq!(f.locate("limits.frame_max", Point::Value), None);
        assert_eq!(f.locate("(top level)", Point::Value), None);
    }

    #[test]
    fn syntax_errors_name_line_column_and_key() {
        let cases = [
            (
                "mode = \"embedded\"\n[listen]\namqp = nope\n",
                3,
                8,
                "listen.amqp",
            ),
            ("a = 1\n[x]\nb = 2\n[y]\n!!\n", 5, 3, "y"),
            ("a = 1\n= 2\n", 2, 1, "(top level)"),
            (
                "[[users]]\nname = \"a\"\npassword = \n",
                3,
                12,
                "users[0].password",
            ),
        ];
        for (text, line, column, key) in cases {
            match file(text).check_syntax() {
                Err(ConfigError::Syntax {
                    line: l,
                    column: c,
                    key: k,
                    ..
                }) => assert_eq!((l, c, k.as_str()), (line, column, key), "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn columns_count_characters() {
        assert_eq!(line_and_column("ab\ncdé f", 9), (2, 6));
        assert_eq!(line_and_column("", 5), (1, 1));
    }

    #[test]
    fn segments_split_keys_and_indexes() {
        assert_eq!(
            segments("users[0].permissions[12].vhost"),
            vec![
                Segment::Key("users"),
                Segment::Index(0),
                Segment::Key("permissions"),
                Segment::Index(12),
                Segment::Key("vhost"),
            ]
        );
    }
}
