//! Tool calls: the tools a script offers (`--tools FILE`, OpenAI's `tools` array) go to the chat
//! template, and the calls a reply makes, written in its family's own format, come back as
//! OpenAI `tool_calls` (a function name and its arguments as a JSON string).
//!
//! The format is read from the chat template ([`Format::of_template`]):
//! - `<tool_call>` ... `</tool_call>` blocks (Hermes, Qwen2.5, Qwen3, QwQ, Qwen3.5, SmolLM3,
//!   Granite 4, GLM, MiniMax and others), each holding a JSON object `{"name", "arguments"}`,
//!   Qwen3-Coder's `<function=NAME><parameter=KEY>VALUE</parameter></function>`, or GLM's
//!   `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`;
//! - Mistral's `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}`, or by
//!   `NAME[ARGS]{...}` (Mistral Small 3.2, Devstral, Ministral 3);
//! - Llama 3.1-3.3's JSON reply `{"name": ..., "parameters": {...}}` (or `"arguments"`),
//!   optionally after `<|python_tag|>`.
//!
//! A block that does not parse (cut at `--max-new`, malformed JSON) is not a call: its text
//! stays in the content and [`Parsed::malformed`] counts it.

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// How a family writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `<tool_call>...</tool_call>` blocks.
    Tagged,
    /// `[TOOL_CALLS]` then a JSON array, or `NAME[ARGS]{...}` calls.
    Mistral,
    /// The whole reply a JSON object `{"name", "parameters"}`.
    Llama3,
    /// gpt-oss's Harmony: `to=functions.NAME<|channel|>commentary json<|message|>{...}`.
    Harmony,
}

impl Format {
    /// The call format a chat template describes, if any.
    pub fn of_template(source: &str) -> Option<Format> {
        if source.contains("<|channel|>commentary") {
            Some(Format::Harmony)
        } else if source.contains("<tool_call>") {
            Some(Format::Tagged)
        } else if source.contains("[TOOL_CALLS]") {
            Some(Format::Mistral)
        } else if source.contains("\"parameters\": dictionary") {
            Some(Format::Llama3)
        } else {
            None
        }
    }
}

/// One call, as OpenAI's API gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments, a JSON object.
    pub arguments: Value,
}

impl Call {
    /// The call in OpenAI's shape: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}`, the arguments as a JSON string; `index` numbers the reply's calls.
    pub fn to_openai(&self, index: usize) -> Value {
        serde_json::json!({
            "id": format!("call_{index}"),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments.to_string()},
        })
    }
}

/// A reply, its calls taken out.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    /// The text outside the calls, trimmed.
    pub content: String,
    pub calls: Vec<Call>,
    /// Blocks that looked like calls and did not parse (left in `content`).
    pub malformed: usize,
}

impl Parsed {
    /// The calls in OpenAI's shape, their ids numbered from `first` (`call_N`).
    pub fn openai_calls(&self, first: usize) -> Vec<Value> {
        self.calls
            .iter()
            .enumerate()
            .map(|(i, c)| c.to_openai(first + i))
            .collect()
    }
}

/// OpenAI-shaped calls as people read them: `name(arguments)`, comma-separated; `none`.
pub fn describe(calls: &[Value]) -> String {
    let list: Vec<String> = calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            let (name, args) = (f["name"].as_str(), f["arguments"].as_str());
            format!("{}({})", name.unwrap_or(""), args.unwrap_or(""))
        })
        .collect();
    match list.is_empty() {
        true => "none".to_string(),
        false => list.join(", "),
    }
}

/// The calls in `reply` (an answer, its thinking already apart) written in `format`.
pub fn parse(format: Format, reply: &str) -> Parsed {
    match format {
        Format::Tagged => parse_tagged(reply),
        Format::Mistral => parse_mistral(reply),
        Format::Llama3 => parse_llama3(reply),
        Format::Harmony => parse_harmony(reply),
    }
}

fn parse_harmony(reply: &str) -> Parsed {
    const HEAD: &str = "to=functions.";
    const BODY: &str = "<|message|>";
    let mut out = Parsed::default();
    let Some(first) = reply.find(HEAD) else {
        out.content = reply.trim().to_string();
        return out;
    };
    out.content = reply[..first]
        .trim()
        .trim_end_matches("<|start|>assistant")
        .trim()
        .to_string();
    for call in reply[first..].split(HEAD).skip(1) {
        let name_len = call
            .find(|c: char| !(c.is_alphanumeric() || "_-.".contains(c)))
            .unwrap_or(call.len());
        let args = call
            .find(BODY)
            .map(|at| &call[at + BODY.len()..])
            .map(|a| a.split("<|call|>").next().unwrap_or(a))
            .map(|a| a.trim().trim_end_matches("<|start|>assistant").trim());
        let parsed = args
            .and_then(|a| serde_json::from_str::<Value>(a).ok())
            .filter(Value::is_object)
            .and_then(|a| named(&call[..name_len], a));
        match parsed {
            Some(c) => out.calls.push(c),
            None => out.malformed += 1,
        }
    }
    if out.malformed > 0 {
        out.calls.clear();
        out.content = reply.trim().to_string();
    }
    out
}

fn parse_tagged(reply: &str) -> Parsed {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut out = Parsed::default();
    let mut content = String::new();
    let mut rest = reply;
    while let Some(at) = rest.find(OPEN) {
        content.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        let Some(end) = body.find(CLOSE) else {
            // Cut before its end: not a call.
            out.malformed += 1;
            content.push_str(&rest[at..]);
            rest = "";
            break;
        };
        match tagged_call(&body[..end]) {
            Some(call) => out.calls.push(call),
            None => {
                out.malformed += 1;
                content.push_str(&rest[at..at + OPEN.len() + end + CLOSE.len()]);
            }
        }
        rest = &body[end + CLOSE.len()..];
    }
    content.push_str(rest);
    out.content = content.trim().to_string();
    out
}

/// The inside of one `<tool_call>` block, in any of the three shapes.
fn tagged_call(body: &str) -> Option<Call> {
    let body = body.trim();
    if body.starts_with('{') {
        return json_call(serde_json::from_str(body).ok()?, "arguments");
    }
    if let Some(f) = body.strip_prefix("<function=") {
        // Qwen3-Coder: <function=NAME> <parameter=KEY>VALUE</parameter>... </function>
        let (name, mut params) = f.split_once('>')?;
        let mut args = serde_json::Map::new();
        while let Some(p) = params.find("<parameter=") {
            let (key, tail) = params[p + "<parameter=".len()..].split_once('>')?;
            let (value, after) = tail.split_once("</parameter>")?;
            args.insert(key.trim().to_string(), xml_value(value));
            params = after;
        }
        params.trim().strip_prefix("</function>")?;
        return named(name, Value::Object(args));
    }
    // GLM: NAME <arg_key>KEY</arg_key> <arg_value>VALUE</arg_value> ...
    let (name, mut pairs) = match body.find("<arg_key>") {
        Some(at) => (&body[..at], &body[at..]),
        None => (body, ""),
    };
    let mut args = serde_json::Map::new();
    while let Some(k) = pairs.find("<arg_key>") {
        let (key, tail) = pairs[k + "<arg_key>".len()..].split_once("</arg_key>")?;
        let v = tail.find("<arg_value>")?;
        let (value, after) = tail[v + "<arg_value>".len()..].split_once("</arg_value>")?;
        args.insert(key.trim().to_string(), xml_value(value));
        pairs = after;
    }
    if !pairs.trim().is_empty() || name.trim().contains(char::is_whitespace) {
        return None;
    }
    named(name, Value::Object(args))
}

/// A parameter written as text: JSON where it parses as JSON (numbers, lists), else a string.
fn xml_value(v: &str) -> Value {
    let v = v.trim_matches('\n');
    serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()))
}

fn named(name: &str, arguments: Value) -> Option<Call> {
    let name = name.trim();
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || "_-.:".contains(c));
    ok.then(|| Call {
        name: name.to_string(),
        arguments,
    })
}

/// `{"name": ..., "<key>": {...}}` (the arguments also as a JSON string) as a call.
fn json_call(v: Value, key: &str) -> Option<Call> {
    let name = v.get("name")?.as_str()?;
    let args = match v.get(key).or_else(|| v.get("arguments")) {
        None => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    args.is_object().then_some(())?;
    named(name, args)
}

fn parse_mistral(reply: &str) -> Parsed {
    const MARK: &str = "[TOOL_CALLS]";
    let Some(at) = reply.find(MARK) else {
        return Parsed {
            content: reply.trim().to_string(),
            ..Parsed::default()
        };
    };
    let (before, calls) = (&reply[..at], reply[at..].trim());
    let mut out = Parsed {
        content: before.trim().to_string(),
        ..Parsed::default()
    };
    // Each [TOOL_CALLS] starts a JSON array of calls, or one NAME[ARGS]{...} call.
    let ok = calls.split(MARK).filter(|c| !c.trim().is_empty()).all(|c| {
        let c = c.trim();
        if c.starts_with('[') {
            let Ok(Value::Array(items)) = serde_json::from_str::<Value>(c) else {
                return false;
            };
            let parsed: Option<Vec<Call>> = items
                .into_iter()
                .map(|v| json_call(v, "arguments"))
                .collect();
            parsed.map(|p| out.calls.extend(p)).is_some()
        } else if let Some((name, args)) = c.split_once("[ARGS]") {
            let call = serde_json::from_str(args.trim())
                .ok()
                .filter(Value::is_object)
                .and_then(|a| named(name, a));
            call.map(|c| out.calls.push(c)).is_some()
        } else {
            false
        }
    });
    if !ok {
        out.calls.clear();
        out.malformed = 1;
        out.content = reply.trim().to_string();
    }
    out
}

fn parse_llama3(reply: &str) -> Parsed {
    let text = reply.trim();
    let body = text.strip_prefix("<|python_tag|>").unwrap_or(text).trim();
    let whole = |content: &str, malformed| Parsed {
        content: content.to_string(),
        calls: Vec::new(),
        malformed,
    };
    if !body.starts_with('{') {
        return whole(text, 0);
    }
    // One call, or several separated by semicolons, as the 3.1 models sometimes write.
    let mut calls = Vec::new();
    for part in body.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        match serde_json::from_str(part)
            .ok()
            .and_then(|v| json_call(v, "parameters"))
        {
            Some(c) => calls.push(c),
            None => return whole(text, usize::from(body.contains("\"name\""))),
        }
    }
    Parsed {
        content: String::new(),
        calls,
        malformed: 0,
    }
}

/// `--tool-choice`: the reply must be a call (`Required`: of any tool offered; `Named`: of
/// that one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Required,
    Named(String),
}

impl Choice {
    /// `--tool-choice VALUE`: None for `auto` (the model decides, nothing is held).
    pub fn parse(value: &str, tools: &Value) -> Result<Option<Choice>> {
        match value {
            "auto" => Ok(None),
            "required" => Ok(Some(Choice::Required)),
            "none" => bail!(
                "--tool-choice none: leave --tools out instead (gen holds replies to calls, not away from them)"
            ),
            name => {
                let known = tools
                    .as_array()
                    .is_some_and(|ts| ts.iter().any(|t| t["function"]["name"] == name));
                if !known {
                    bail!("--tool-choice {name}: no tool of that name in --tools");
                }
                Ok(Some(Choice::Named(name.to_string())))
            }
        }
    }
}

/// A grammar (llguidance's Lark syntax) holding a reply to one call in `format`, its
/// arguments valid under the tool's `parameters` schema, as `choice` asks.
pub fn choice_grammar(format: Format, tools: &Value, choice: &Choice) -> Result<String> {
    let key = match format {
        Format::Tagged => "arguments",
        Format::Llama3 => "parameters",
        Format::Mistral | Format::Harmony => bail!(
            "--tool-choice: this format's calls begin with control tokens gen cannot hold a reply to yet; use --tool-choice auto"
        ),
    };
    let schemas: Vec<Value> = tools
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| match choice {
            Choice::Required => true,
            Choice::Named(n) => t["function"]["name"] == n.as_str(),
        })
        .map(|t| {
            let f = &t["function"];
            let params = match &f["parameters"] {
                Value::Null => serde_json::json!({"type": "object"}),
                p => p.clone(),
            };
            serde_json::json!({
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = match schemas.len() {
        0 => bail!("--tool-choice: no tool to call"),
        1 => schemas.into_iter().next().unwrap_or_default(),
        _ => serde_json::json!({"anyOf": schemas}),
    };
    let call = format!("call: %json {schema}");
    Ok(match format {
        Format::Tagged => format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\n{call}\n"),
        _ => format!("start: call\n{call}\n"),
    })
}

/// Read `--tools FILE`: OpenAI's `tools` array (or an object holding one under `"tools"`),
/// each `{"type": "function", "function": {"name", "description"?, "parameters"?}}`.
pub fn read_tools(path: &std::path::Path) -> Result<Value> {
    let shown = path.display();
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read --tools {shown}"))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("--tools {shown} is not JSON"))?;
    let tools = match v {
        Value::Object(mut o) if o.contains_key("tools") => o.remove("tools").unwrap_or_default(),
        v => v,
    };
    let Value::Array(items) = &tools else {
        bail!("--tools {shown}: expected an array of tools (OpenAI's \"tools\")");
    };
    for (i, t) in items.iter().enumerate() {
        let f = &t["function"];
        if t["type"] != "function" || !f["name"].is_string() {
            bail!(
                "--tools {shown}: tool {i} is not {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}"
            );
        }
        if !f["parameters"].is_null() && !f["parameters"].is_object() {
            bail!("--tools {shown}: tool {i}'s parameters are not a JSON Schema object");
        }
    }
    Ok(tools)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> Call {
        Call {
            name: name.into(),
            arguments: args,
        }
    }

    #[test]
    fn tagged_blocks_in_every_shape() {
        let p = parse(
            Format::Tagged,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(p.content, "Let me check.");
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", json!({"city": "Paris"})),
                call("now", json!({}))
            ]
        );
        // Qwen3-Coder's XML parameters, numbers kept as numbers.
        let p = parse(
            Format::Tagged,
            "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=note>\nhi there\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(
            p.calls,
            vec![call("add", json!({"a": 2, "note": "hi there"}))]
        );
        // GLM's key/value pairs.
        let p = parse(
            Format::Tagged,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        );
        assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Paris"}))]);
        // Arguments given as a JSON string are read as the object they hold.
        let p = parse(
            Format::Tagged,
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>",
        );
        assert_eq!(p.calls, vec![call("f", json!({"x": 1}))]);
    }

    #[test]
    fn cut_and_malformed_blocks_are_not_calls() {
        let cut = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu";
        let p = parse(Format::Tagged, cut);
        assert!(p.calls.is_empty());
        assert_eq!((p.malformed, p.content.as_str()), (1, cut));
        let bad = "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call> ok";
        let p = parse(Format::Tagged, bad);
        assert!(p.calls.is_empty() && p.malformed == 1);
        assert_eq!(p.content, bad);
        let p = parse(Format::Tagged, "<tool_call>not json at all</tool_call>");
        assert_eq!(p.malformed, 1);
        // No call at all: the reply is the content.
        let p = parse(Format::Tagged, "  Just text.\n");
        assert_eq!(
            (p.content.as_str(), p.calls.len(), p.malformed),
            ("Just text.", 0, 0)
        );
    }

    #[test]
    fn mistral_arrays_and_name_args_calls() {
        let p = parse(
            Format::Mistral,
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"now\", \"arguments\": {}}]",
        );
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.content, "");
        let p = parse(
            Format::Mistral,
            "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}",
        );
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", json!({"city": "Paris"})),
                call("now", json!({}))
            ]
        );
        let p = parse(Format::Mistral, "[TOOL_CALLS][{\"name\": \"get_wea");
        assert!(p.calls.is_empty() && p.malformed == 1);
        assert_eq!(parse(Format::Mistral, "Hello").content, "Hello");
    }

    #[test]
    fn harmony_calls() {
        let p = parse(
            Format::Harmony,
            "to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}",
        );
        assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Paris"}))]);
        assert_eq!(p.content, "");
        let cut = "to=functions.get_weather<|channel|>commentary json<|message|>{\"ci";
        let p = parse(Format::Harmony, cut);
        assert!(p.calls.is_empty() && p.malformed == 1);
        assert_eq!(p.content, cut);
        assert_eq!(parse(Format::Harmony, "Hello.").content, "Hello.");
        assert_eq!(
            Format::of_template("<|channel|>commentary <|message|>"),
            Some(Format::Harmony)
        );
    }

    #[test]
    fn llama3_json_replies() {
        let p = parse(
            Format::Llama3,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        );
        assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Paris"}))]);
        let p = parse(
            Format::Llama3,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {}}",
        );
        assert_eq!(p.calls.len(), 2);
        let p = parse(Format::Llama3, "{\"name\": \"a\", \"parameters\": {");
        assert!(p.calls.is_empty() && p.malformed == 1);
        let p = parse(Format::Llama3, "The answer is 4.");
        assert_eq!((p.content.as_str(), p.malformed), ("The answer is 4.", 0));
    }

    #[test]
    fn tool_choice_grammars_hold_a_call_to_its_schema() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b"}}
        ]);
        assert_eq!(Choice::parse("auto", &tools).unwrap(), None);
        assert_eq!(
            Choice::parse("b", &tools).unwrap(),
            Some(Choice::Named("b".into()))
        );
        assert!(Choice::parse("c", &tools).is_err());
        assert!(Choice::parse("none", &tools).is_err());
        let g = choice_grammar(Format::Tagged, &tools, &Choice::Named("a".into())).unwrap();
        assert!(
            g.starts_with("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {"),
            "{g}"
        );
        assert!(
            g.contains("\"const\":\"a\"") && !g.contains("\"const\":\"b\""),
            "{g}"
        );
        let g = choice_grammar(Format::Llama3, &tools, &Choice::Required).unwrap();
        assert!(g.contains("anyOf") && g.contains("\"parameters\""), "{g}");
        assert!(choice_grammar(Format::Mistral, &tools, &Choice::Required).is_err());
    }

    #[test]
    fn calls_come_out_in_openai_shape() {
        let v = call("f", json!({"x": 1})).to_openai(0);
        assert_eq!(v["id"], "call_0");
        assert_eq!(v["function"]["arguments"], "{\"x\":1}");
    }

    #[test]
    fn formats_are_found_in_templates() {
        assert_eq!(Format::of_template("x <tool_call> y"), Some(Format::Tagged));
        assert_eq!(Format::of_template("[TOOL_CALLS]"), Some(Format::Mistral));
        assert_eq!(
            Format::of_template("{\"name\": function name, \"parameters\": dictionary of ...}"),
            Some(Format::Llama3)
        );
        assert_eq!(Format::of_template("{{ messages }}"), None);
    }
}
