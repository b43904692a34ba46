//! Python's text forms of template values, as transformers' Jinja writes them: `tojson` is
//! `json.dumps` (non-ASCII kept unless `ensure_ascii`, with `indent`, `separators` and
//! `sort_keys`), and printing a value is Python's `str()` (`None`, `True`, `['a', 1]`).
//! And Python's `None` for the values transformers passes as None.

use std::sync::Arc;

use minijinja::value::{Kwargs, Object, ObjectRepr, Rest, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// Python's `None` as jinja2 sees it, for `tools` and `documents`: defined, false, printed
/// `None`, `null` in JSON, and (unlike minijinja's own none, which loops as empty) neither
/// iterable nor of any length, so `{% for t in tools %}` fails as it fails under transformers.
#[derive(Debug)]
pub struct PyNone;

impl Object for PyNone {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }

    fn is_true(self: &Arc<Self>) -> bool {
        false
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("None")
    }
}

/// `value is none`: minijinja's none or [`PyNone`].
pub fn is_none(value: &Value) -> bool {
    value.is_none() || value.downcast_object_ref::<PyNone>().is_some()
}

/// `value is iterable` as jinja2 decides it: strings, lists, dicts and undefined are; none,
/// numbers and booleans are not.
pub fn is_iterable(value: &Value) -> bool {
    !is_none(value) && value.try_iter().is_ok()
}

/// jinja2's select, reject, selectattr, rejectattr and map give nothing for a false value
/// (`None`, `0`, `''`) where minijinja's would fail: these wrap minijinja's own. Like jinja2's,
/// what they give is a generator: iterated once, with no length, and not JSON (`tojson`
/// refuses it as `json.dumps` does).
pub fn add_empty_on_false_filters(env: &mut minijinja::Environment<'_>) {
    use minijinja::filters;
    use std::borrow::Cow::Owned;
    type Seq = Result<Value, Error>;
    let gen = |v: Result<Vec<Value>, Error>| -> Seq {
        v.map(|items| Value::make_one_shot_iterator(items.into_iter()))
    };
    let empty = |v: &Value| !v.is_true();
    env.add_filter(
        "select",
        move |s: &State, v: Value, t: Option<String>, a: Rest<Value>| -> Seq {
            gen(match empty(&v) {
                true => Ok(Vec::new()),
                false => filters::select(s, v, t.map(Owned), a),
            })
        },
    );
    env.add_filter(
        "reject",
        move |s: &State, v: Value, t: Option<String>, a: Rest<Value>| -> Seq {
            gen(match empty(&v) {
                true => Ok(Vec::new()),
                false => filters::reject(s, v, t.map(Owned), a),
            })
        },
    );
    env.add_filter(
        "selectattr",
        move |s: &State, v: Value, attr: String, t: Option<String>, a: Rest<Value>| -> Seq {
            gen(match empty(&v) {
                true => Ok(Vec::new()),
                false => filters::selectattr(s, v, Owned(attr), t.map(Owned), a),
            })
        },
    );
    env.add_filter(
        "rejectattr",
        move |s: &State, v: Value, attr: String, t: Option<String>, a: Rest<Value>| -> Seq {
            gen(match empty(&v) {
                true => Ok(Vec::new()),
                false => filters::rejectattr(s, v, Owned(attr), t.map(Owned), a),
            })
        },
    );
    env.add_filter("map", move |s: &State, v: Value, a: Rest<Value>| -> Seq {
        gen(match empty(&v) {
            true => Ok(Vec::new()),
            false => filters::map(s, v, a),
        })
    });
}

/// How `json.dumps` lays out its text.
struct JsonStyle {
    ensure_ascii: bool,
    /// `None`: all on one line; `Some(unit)`: one item a line, indented by `unit` a level.
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, arguments given by position or by name.
pub fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(NAMES[i])?;
        Ok(named.or_else(|| args.get(i).cloned()))
    };
    let ensure_ascii = arg(0)?.is_some_and(|v| v.is_true());
    let indent = match arg(1)? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => {
            let n =
                i64::try_from(v).map_err(|_| bad_arg("indent must be an integer or a string"))?;
            Some(" ".repeat(n.clamp(0, 64) as usize))
        }
    };
    let (item_sep, key_sep) = match arg(2)? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v
                .try_iter()
                .map_err(|_| bad_arg("separators must be a pair of strings"))?
                .collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.to_string(), b.to_string())
                }
                _ => return Err(bad_arg("separators must be a pair of strings")),
            }
        }
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let sort_keys = arg(3)?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        ensure_ascii,
        indent,
        item_sep,
        key_sep,
        sort_keys,
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(out)
}

fn bad_arg(msg: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, format!("tojson: {msg}"))
}

fn not_serializable(value: &Value) -> Error {
    let kind = match value.kind() {
        ValueKind::Iterable => "generator".to_string(), // what jinja2's filters give
        k => k.to_string(),
    };
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {kind} is not JSON serializable"),
    )
}

/// jinja2's `indent(s, width=4, first=False, blank=False)`: every line but the first (and the
/// first too with `first`) indented by `width` spaces (or that string), blank lines only with
/// `blank`; a trailing newline is kept, as jinja2 keeps it.
pub fn indent(s: &str, args: Rest<Value>, kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 3] = ["width", "first", "blank"];
    if args.len() > NAMES.len() {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(NAMES[i])?;
        Ok(named.or_else(|| args.get(i).cloned()))
    };
    let unit = match arg(0)? {
        None => "    ".to_string(),
        Some(v) if v.kind() == ValueKind::String => v.as_str().unwrap_or("").to_string(),
        Some(v) => {
            let n = i64::try_from(v).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    "indent: width must be a number",
                )
            })?;
            " ".repeat(n.clamp(0, 256) as usize)
        }
    };
    let first = arg(1)?.is_some_and(|v| v.is_true());
    let blank = arg(2)?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    // Python: s += "\n"; lines = s.splitlines() (which ends no line with the added newline).
    let text = format!("{s}\n");
    let lines: Vec<&str> = py_splitlines(&text);
    let mut rv = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            rv.push('\n');
            if blank || !line.is_empty() {
                rv.push_str(&unit);
            }
        }
        rv.push_str(line);
    }
    if first {
        rv.insert_str(0, &unit);
    }
    Ok(rv)
}

/// Python's `str.splitlines()` for the line ends chat templates meet (`\n`, `\r\n`, `\r`).
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\n' => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            b'\r' => {
                out.push(&s[start..i]);
                if b.get(i + 1) == Some(&b'\n') {
                    i += 1;
                }
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> Result<(), Error> {
    if depth > 256 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: nested too deeply",
        ));
    }
    if is_none(value) {
        out.push_str("null");
        return Ok(());
    }
    match value.kind() {
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)),
        ValueKind::String => json_string(out, value.as_str().unwrap_or(""), style.ensure_ascii),
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, ('[', ']'), items.len(), style, depth, |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, ('{', '}'), entries.len(), style, depth, |out, i| {
                json_string(out, &entries[i].0, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, &entries[i].1, style, depth + 1)
            })?;
        }
        _ => return Err(not_serializable(value)),
    }
    Ok(())
}

/// `[a, b]` / `{...}` with `json.dumps`'s separators and, with an indent, one item a line.
fn write_container(
    out: &mut String,
    (open, close): (char, char),
    len: usize,
    style: &JsonStyle,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(unit) = &style.indent {
            out.push('\n');
            (0..level).for_each(|_| out.push_str(unit));
        }
    };
    newline(out, depth + 1);
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
            newline(out, depth + 1);
        }
        item(out, i)?;
    }
    newline(out, depth);
    out.push(close);
    Ok(())
}

/// Dict keys as `json.dumps` turns them into strings.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or("").to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number => Ok(json_number(key)),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) if f.is_nan() => "NaN".into(),
        Ok(f) if f.is_infinite() => if f > 0.0 { "Infinity" } else { "-Infinity" }.into(),
        Ok(f) => float_repr(f),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`: the shortest text that reads back the same, in exponent form below
/// 1e-4 and from 1e16 on (`1e-05`, `1e+16`), else with at least one decimal (`2.0`).
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mantissa}e{sign}{digits:0>2}");
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str(value)`, which Jinja writes for `{{ value }}`: strings as they are, `None`,
/// `True`, `False`, floats as `repr`, lists and dicts as their `repr`, undefined as nothing.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or("").to_string(),
        _ => py_repr(value, 0),
    }
}

/// Python's `repr(value)` for the values a template holds.
fn py_repr(value: &Value, depth: usize) -> String {
    if depth > 64 {
        return "[...]".into();
    }
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => f64::try_from(value.clone())
            .map(float_repr)
            .unwrap_or_else(|_| value.to_string()),
        ValueKind::String => str_repr(value.as_str().unwrap_or("")),
        ValueKind::Seq => match value.try_iter() {
            Ok(items) => {
                let items: Vec<String> = items.map(|v| py_repr(&v, depth + 1)).collect();
                format!("[{}]", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let entries: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", py_repr(&k, depth + 1), py_repr(&v, depth + 1))
                    })
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds one and no double quote.
fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use minijinja::Environment;

    fn render(src: &str) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.set_formatter(|out, _state, value| {
            out.write_str(&py_str(value))
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
        });
        let none = Value::from_object(PyNone);
        env.render_str(src, minijinja::context! { py_none => none })
            .unwrap()
    }

    const V: &str =
        r#"{% set v = {"name": "café \"x\"\n", "n": [1, 2.5, none, true], "e": {}, "l": []} %}"#;

    /// Expected texts are what Python 3's json.dumps and str() write for the same values.
    #[test]
    fn indent_and_generators_behave_as_jinja2s() {
        let mut env = minijinja::Environment::new();
        env.add_filter("indent", indent);
        env.add_filter("tojson", tojson);
        add_empty_on_false_filters(&mut env);
        let r = |src: &str| {
            env.render_str(src, minijinja::context! { v => vec![1, 2] })
                .map_err(|e| e.to_string())
        };
        // A trailing newline stays; blank lines are not indented unless asked.
        assert_eq!(r("{{ '{\n'|indent(4, first=true) }}").unwrap(), "    {\n");
        assert_eq!(r("{{ 'a\n\nb'|indent(2) }}").unwrap(), "a\n\n  b");
        assert_eq!(
            r("{{ 'a\n\nb'|indent(2, blank=true) }}").unwrap(),
            "a\n  \n  b"
        );
        assert_eq!(r("{{ 'a\nb'|indent('> ') }}").unwrap(), "a\n> b");
        // map and friends give generators: iterable, not JSON.
        assert_eq!(r("{{ v|map('string')|join(',') }}").unwrap(), "1,2");
        let e = r("{{ v|map('string')|tojson }}").unwrap_err();
        assert!(
            e.contains("Object of type generator is not JSON serializable"),
            "{e}"
        );
    }

    #[test]
    fn tojson_is_json_dumps() {
        assert_eq!(
            render(&format!("{V}{{{{ v|tojson }}}}")),
            r#"{"name": "café \"x\"\n", "n": [1, 2.5, null, true], "e": {}, "l": []}"#
        );
        assert_eq!(
            render(&format!("{V}{{{{ v|tojson(indent=2, sort_keys=true) }}}}")),
            "{\n  \"e\": {},\n  \"l\": [],\n  \"n\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"name\": \"café \\\"x\\\"\\n\"\n}"
        );
        assert_eq!(
            render(&format!("{V}{{{{ v.n|tojson(separators=(',', ':')) }}}}")),
            "[1,2.5,null,true]"
        );
        assert_eq!(
            render("{{ 'é😀\x7f'|tojson(ensure_ascii=true) }}"),
            r#""\u00e9\ud83d\ude00\u007f""#
        );
        assert_eq!(
            render("{{ {none: 1.0, 'x': 1e20, 'y': 1e-5, 't': py_none}|tojson(indent='\t') }}"),
            "{\n\t\"null\": 1.0,\n\t\"x\": 1e+20,\n\t\"y\": 1e-05,\n\t\"t\": null\n}"
        );
    }

    #[test]
    fn values_print_as_python_prints_them() {
        assert_eq!(
            render(
                r#"{{ {'a': [1, 0.5, none, false, "it's"], 'b': 1e20} }}|{{ none }}|{{ true }}|{{ nothing }}|{{ 1e-5 }}|{{ py_none }}"#
            ),
            r#"{'a': [1, 0.5, None, False, "it's"], 'b': 1e+20}|None|True||1e-05|None"#
        );
    }

    #[test]
    fn python_none_is_defined_false_and_not_iterable() {
        let mut env = Environment::new();
        env.add_test("none", is_none);
        env.add_test("iterable", is_iterable);
        let ctx = minijinja::context! { tools => Value::from_object(PyNone) };
        let r = |src: &str| env.render_str(src, ctx.clone());
        assert_eq!(
            r("{{ tools is defined }} {{ tools is none }} {{ not tools }} {{ tools is iterable }} {{ none is iterable }} {{ 'ab' is iterable }} {{ nothing is iterable }}").unwrap(),
            "True True True False False True True"
        );
        assert!(r("{% for t in tools %}{{ t }}{% endfor %}").is_err());
        assert!(r("{{ tools|length }}").is_err());
    }
}
