//! Log lines on stderr (SPEC §8): one line per event, as text or as one JSON
//! object per line, every line carrying the key and the owner.
//!
//! A small layer of our own rather than the fmt subscriber: it puts the
//! key and owner on every line without spans, keeps JSON flat (`jq .token`
//! works), and writes each line with a single `write` so lines from
//! concurrent replicas sharing a stderr do not interleave.

use std::fmt::{self, Write as _};
use std::io::Write as _;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use crate::cli::{LogArgs, LogFormat};
use crate::error::ConfigError;

/// Installs the logger. `fields` are added to every line (key, owner).
pub fn init(args: &LogArgs, fields: Vec<(&'static str, String)>) -> Result<(), ConfigError> {
    let filter = match (args.verbose, args.quiet) {
        (0, 0) => match std::env::var("LEADERRUN_LOG") {
            Ok(directive) if !directive.is_empty() => {
                EnvFilter::try_new(&directive).map_err(|e| ConfigError::LogDirective {
                    directive,
                    why: e.to_string(),
                })?
            }
            _ => EnvFilter::new("info"),
        },
        (1, _) => EnvFilter::new("debug"),
        (_, 0) => EnvFilter::new("trace"),
        (_, 1) => EnvFilter::new("warn"),
        _ => EnvFilter::new("error"),
    };
    tracing_subscriber::registry()
        .with(filter)
        .with(Lines {
            json: args.log_format == LogFormat::Json,
            fields,
        })
        .init();
    Ok(())
}

struct Lines {
    json: bool,
    fields: Vec<(&'static str, String)>,
}

/// A field value, kept typed so JSON numbers and booleans stay unquoted.
#[derive(Clone)]
enum Value {
    Text(String),
    Raw(String),
}

#[derive(Default)]
struct Fields {
    message: String,
    values: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_owned();
        } else {
            self.values
                .push((field.name(), Value::Text(value.to_owned())));
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.values
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.values
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.values
            .push((field.name(), Value::Raw(value.to_string())));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }
}

/// The fields of a span (shard mode's `shard`), put on every line logged
/// inside it.
struct SpanFields(Vec<(&'static str, Value)>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Lines {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields.values));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(SpanFields(values)) = span.extensions().get::<SpanFields>() {
                    fields.values.extend(values.iter().cloned());
                }
            }
        }
        event.record(&mut fields);
        let time = humantime::format_rfc3339_millis(std::time::SystemTime::now());
        let level = *event.metadata().level();
        let context = self
            .fields
            .iter()
            .map(|(name, value)| (*name, Value::Text(value.clone())));
        let all: Vec<(&str, Value)> = context.chain(fields.values).collect();
        let line = if self.json {
            json_line(&time.to_string(), level, &fields.message, &all)
        } else {
            text_line(&time.to_string(), level, &fields.message, &all)
        };
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

fn text_line(time: &str, level: Level, message: &str, fields: &[(&str, Value)]) -> String {
    let mut line = format!("{time} {level:>5} {message}");
    for (name, value) in fields {
        match value {
            Value::Raw(raw) => write!(line, " {name}={raw}"),
            Value::Text(text)
                if text.is_empty()
                    || text.contains(|c: char| c.is_whitespace() || c == '"' || c.is_control()) =>
            {
                write!(line, " {name}={text:?}")
            }
            Value::Text(text) => write!(line, " {name}={text}"),
        }
        .expect("writing to a String");
    }
    line.push('\n');
    line
}

fn json_line(time: &str, level: Level, message: &str, fields: &[(&str, Value)]) -> String {
    let mut line = String::from("{");
    let level = level.as_str().to_ascii_lowercase();
    for (name, value) in [("time", time), ("level", level.as_str()), ("msg", message)] {
        push_json_string(&mut line, name);
        line.push(':');
        push_json_string(&mut line, value);
        line.push(',');
    }
    for (name, value) in fields {
        push_json_string(&mut line, name);
        line.push(':');
        match value {
            Value::Raw(raw) => line.push_str(raw),
            Value::Text(text) => push_json_string(&mut line, text),
        }
        line.push(',');
    }
    line.pop();
    line.push_str("}\n");
    line
}

/// `text` as a JSON string literal.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    push_json_string(&mut out, text);
    out
}

fn push_json_string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                write!(out, "\\u{:04x}", c as u32).expect("writing to a String")
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_lines_escape_and_keep_numbers_raw() {
        let fields = [
            ("key", Value::Text("a\"b\\c\n".into())),
            ("token", Value::Raw("7".into())),
        ];
        let line = json_line("T", Level::INFO, "lease acquired", &fields);
        assert_eq!(
            line,
            "{\"time\":\"T\",\"level\":\"info\",\"msg\":\"lease acquired\",\"key\":\"a\\\"b\\\\c\\n\",\"token\":7}\n"
        );
    }

    #[test]
    fn text_lines_quote_only_what_needs_it() {
        let fields = [
            ("key", Value::Text("plain".into())),
            ("error", Value::Text("two words".into())),
            ("token", Value::Raw("7".into())),
        ];
        let line = text_line("T", Level::WARN, "renewal failed", &fields);
        assert_eq!(
            line,
            "T  WARN renewal failed key=plain error=\"two words\" token=7\n"
        );
    }
}
