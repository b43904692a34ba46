//! Chat prompts: render the model's own chat template (Jinja, from the GGUF metadata or a
//! tokenizer_config.json) into the text the model was trained on.
//!
//! The render is the one Hugging Face transformers' `apply_chat_template` makes with Python's
//! jinja2: trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
//! `tojson` as `json.dumps`, Python's str/dict/list methods, `tools` and `documents` as None,
//! and its `{% generation %}` tag. tests/chat_templates.rs holds gen to that, byte for byte,
//! on the real templates under assets/chat-templates.
//!
//! A template is code that came with a file from a stranger: rendering runs on a fuel budget
//! and a bounded recursion depth, so a template that loops forever fails with an error.

use std::borrow::Cow;

use anyhow::Result;
use minijinja::value::{Kwargs, Value};
use minijinja::{context, Environment, Error, ErrorKind, State};
use serde::Serialize;

mod clock;
mod python;

pub use clock::LocalTime;

/// Enough for any real template over a long conversation; a runaway loop exhausts it quickly.
const TEMPLATE_FUEL: u64 = 2_000_000;

/// What `{% generation %}` blocks become: a call block of this function, which renders its body.
const GENERATION_FN: &str = "__gen_generation_block";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, in OpenAI's shape (`{"id", "type", "function": {"name",
    /// "arguments"}}`), as the templates read them.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A tool result's call id (role `tool`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tool_call_id: Option<String>,
    /// A tool result's function name (role `tool`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub name: Option<String>,
}

impl Message {
    /// A plain message of `role` holding `content`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A chat template with the special tokens it may refer to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    /// `enable_thinking` for templates that read it (None: not set, the template's default).
    enable_thinking: Option<bool>,
    /// The tools offered (OpenAI's `tools` array), or None.
    tools: Option<serde_json::Value>,
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> Self {
        Self {
            source,
            bos_token,
            eos_token,
            enable_thinking: None,
            tools: None,
        }
    }

    /// Render with `tools` (OpenAI's `tools` array) offered to the model, or none.
    pub fn with_tools(mut self, tools: Option<serde_json::Value>) -> Self {
        self.tools = tools;
        self
    }

    /// The tool-call format the template describes, if any ([`crate::tool_calls`]).
    pub fn tool_format(&self) -> Option<crate::tool_calls::Format> {
        crate::tool_calls::Format::of_template(&self.source)
    }

    /// Render with `enable_thinking` set (`--reasoning on|off`), or not set (None).
    pub fn with_thinking(mut self, enable_thinking: Option<bool>) -> Self {
        self.enable_thinking = enable_thinking;
        self
    }

    /// The template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The thinking format the template writes, if any ([`crate::reasoning`]).
    pub fn reasoning_format(&self) -> Option<crate::reasoning::Format> {
        crate::reasoning::Format::of_template(&self.source)
    }

    /// Render `messages` and, with `add_generation_prompt`, the opening of the assistant's turn.
    /// A template that asks for the date (`strftime_now`) gets today's, in local time.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_at(messages, add_generation_prompt, LocalTime::now())
    }

    /// [`ChatTemplate::render`] with `now` as the time `strftime_now` reads.
    ///
    /// The text is what Hugging Face transformers' `apply_chat_template` renders (Python's
    /// jinja2 with trim_blocks and lstrip_blocks, `tools` and `documents` set to none). A
    /// template that does not parse, raises, or runs out of fuel is an error of one line.
    pub fn render_at(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        now: LocalTime,
    ) -> Result<String> {
        let env = environment(now);
        let source = rewrite_generation_tags(&self.source);
        let tmpl = env
            .template_from_named_str("chat template", &source)
            .map_err(|e| {
                anyhow::anyhow!("the model's chat template does not parse: {}", one_line(&e))
            })?;
        // Tool-call arguments as OpenAI sends them (a JSON string) become the object they
        // hold, as the templates read them (llama.cpp's server does the same).
        let messages: Vec<Message> = messages.iter().map(with_argument_objects).collect();
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => match &self.tools {
                Some(t) => Value::from_serialize(t),
                None => Value::from_object(python::PyNone),
            },
            documents => Value::from_object(python::PyNone),
        };
        let ctx = match self.enable_thinking {
            Some(on) => context! { enable_thinking => on, ..ctx },
            None => ctx,
        };
        tmpl.render(ctx).map_err(|e| {
            anyhow::anyhow!(
                "rendering the model's chat template failed: {}",
                one_line(&e)
            )
        })
    }
}

/// A Jinja environment set up as transformers sets up jinja2 for chat templates, on a fuel
/// budget and a bounded recursion depth.
fn environment(now: LocalTime) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_recursion_limit(64);
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Templates written for Python's Jinja call str, dict and list methods such as .strip(),
    // .startswith(), .items() and .get().
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // `{{ value }}` and `|string` write Python's str(value): None, True, ['a'].
    env.set_formatter(|out, _state, value| {
        out.write_str(&python::py_str(value))
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write the render"))
    });
    env.add_filter("string", |v: &Value| python::py_str(v));
    env.add_filter("tojson", python::tojson);
    env.add_filter("indent", python::indent);
    python::add_empty_on_false_filters(&mut env);
    env.add_test("none", python::is_none);
    env.add_test("iterable", python::is_iterable);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", move |format: String| now.strftime(&format));
    env.add_function(GENERATION_FN, generation_block);
    env
}

/// The body of a `{% generation %}` block, rendered as it stands (transformers uses the block
/// only to find the assistant's tokens).
fn generation_block(state: &State, kwargs: Kwargs) -> Result<Value, Error> {
    let caller: Value = kwargs.get("caller")?;
    kwargs.assert_all_used()?;
    caller.call(state, &[])
}

/// `{% generation %}` and `{% endgeneration %}` (transformers' own tag) as a call block of
/// [`GENERATION_FN`], keeping their whitespace control, so minijinja can parse the template.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let tag = &rest[2..];
        let (open, tag) = split_control(tag);
        let body = tag.trim_start();
        let word_end = body
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(body.len());
        let (word, after) = body.split_at(word_end);
        let after = after.trim_start();
        let close = tag_end(after);
        match (word, close) {
            ("generation" | "endgeneration", Some((close, len))) => {
                let inner = if word == "generation" {
                    format!("call {GENERATION_FN}()")
                } else {
                    "endcall".to_string()
                };
                out.push_str(&format!("{{%{open} {inner} {close}%}}"));
                rest = &after[len..];
            }
            _ => {
                out.push_str("{%");
                rest = &rest[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// A tag's leading whitespace control (`-` or `+`), if any, and the rest of the tag.
fn split_control(tag: &str) -> (&str, &str) {
    match tag.as_bytes().first() {
        Some(b'-' | b'+') => tag.split_at(1),
        _ => ("", tag),
    }
}

/// The end of a block tag at the start of `s`: its whitespace control and its length.
fn tag_end(s: &str) -> Option<(&str, usize)> {
    if s.starts_with("%}") {
        Some(("", 2))
    } else if s.starts_with("-%}") || s.starts_with("+%}") {
        Some((&s[..1], 3))
    } else {
        None
    }
}

/// A template error as one line: its kind, its message and where in the template it stopped.
fn one_line(e: &Error) -> String {
    e.to_string().replace(['\n', '\r'], " ")
}

/// `m` with each tool call's `function.arguments`, when a JSON string holding an object, as
/// that object.
fn with_argument_objects(m: &Message) -> Message {
    let mut m = m.clone();
    for call in m.tool_calls.iter_mut().flatten() {
        let args = &mut call["function"]["arguments"];
        if let Some(obj) = args
            .as_str()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
            .filter(serde_json::Value::is_object)
        {
            *args = obj;
        }
    }
    m
}

/// The conversation for a one-shot prompt: an optional system message, then the user's text.
pub fn one_shot(system: Option<&str>, user: &str) -> Vec<Message> {
    let mut m = Vec::new();
    if let Some(s) = system {
        m.push(Message::new("system", s));
    }
    m.push(Message::new("user", user));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn t(src: &str) -> ChatTemplate {
        ChatTemplate::new(src.into(), "<s>".into(), "</s>".into())
    }

    #[test]
    fn chatml_with_default_system() {
        let out = t(CHATML).render(&one_shot(None, "Hi"), true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chatml_with_given_system_and_no_generation_prompt() {
        let out = t(CHATML)
            .render(&one_shot(Some("Be brief."), "Hi"), false)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn python_string_methods_and_special_tokens_work() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m['content'].strip() }}{% endfor %}{{ eos_token }}";
        assert_eq!(
            t(src).render(&one_shot(None, "  x  "), true).unwrap(),
            "<s>x</s>"
        );
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let src = "{{ raise_exception('only user and assistant roles') }}";
        let err = t(src).render(&one_shot(None, "x"), true).unwrap_err();
        assert!(
            format!("{err:#}").contains("only user and assistant roles"),
            "{err:#}"
        );
    }

    #[test]
    fn runaway_templates_are_stopped() {
        let looping =
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        assert!(t(looping).render(&one_shot(None, "x"), true).is_err());
        let recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        assert!(t(recursive).render(&one_shot(None, "x"), true).is_err());
        assert!(t("{% for %}").render(&one_shot(None, "x"), true).is_err());
    }

    const PI_DAY: LocalTime = LocalTime {
        year: 2026,
        month: 3,
        day: 14,
        hour: 9,
        minute: 26,
        second: 53,
    };

    #[test]
    fn block_tags_leave_no_stray_newlines_or_indentation() {
        // jinja2 under transformers: trim_blocks drops the newline after a block tag,
        // lstrip_blocks the indentation before one.
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
        let out = t(src).render(&one_shot(Some("s"), "u"), false).unwrap();
        assert_eq!(out, "[u]\n");
    }

    #[test]
    fn strftime_now_reads_the_given_clock_or_today() {
        let src = "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%B %d, %Y') }}";
        let msgs = one_shot(None, "x");
        assert_eq!(
            t(src).render_at(&msgs, true, PI_DAY).unwrap(),
            "14 Mar 2026|March 14, 2026"
        );
        let before = LocalTime::now().strftime("%Y-%m-%d");
        let today = t("{{ strftime_now('%Y-%m-%d') }}")
            .render(&msgs, true)
            .unwrap();
        let after = LocalTime::now().strftime("%Y-%m-%d");
        assert!(
            today == before || today == after,
            "{today} vs {before}..{after}"
        );
    }

    #[test]
    fn loop_controls_and_generation_blocks_work() {
        let src = "{%- for m in messages -%}{%- if m.role == 'system' %}{% continue %}{% endif -%}\n{%- generation -%}\n{%- set seen = m.content -%}<{{ seen }}>\n{%- endgeneration -%}{% break %}{%- endfor -%}({{ seen }})";
        let mut msgs = one_shot(Some("s"), "a");
        msgs.extend(one_shot(None, "b"));
        // As in jinja2, a `set` inside the block stays inside it.
        assert_eq!(t(src).render(&msgs, true).unwrap(), "<a>()");
    }

    #[test]
    fn tools_and_documents_are_python_none() {
        let src = "{{ tools is none }} {{ tools is defined }} {{ documents }} {{ tools|tojson }} {{ tools|selectattr('type')|list|length }}";
        assert_eq!(
            t(src).render(&one_shot(None, "x"), true).unwrap(),
            "True True None null 0"
        );
        // jinja2 cannot iterate None: the template fails rather than rendering without tools.
        let err = t("{% for tool in tools %}{{ tool }}{% endfor %}")
            .render(&one_shot(None, "x"), true)
            .unwrap_err();
        assert!(format!("{err:#}").contains("not iterable"), "{err:#}");
    }

    #[test]
    fn bad_templates_fail_in_one_line() {
        for src in [
            "{% for %}",
            "{% if x %}\nunclosed\n",
            "{{ messages[0].content.nope.deeper }}",
            "{{ raise_exception('bad\nrole') }}",
            "{% generation %}never closed",
        ] {
            let err = t(src).render(&one_shot(None, "x"), true).unwrap_err();
            let text = format!("{err:#}");
            assert!(
                !text.contains('\n') && text.contains("chat template"),
                "{text:?}"
            );
        }
    }

    /// Gemma 3's template (google/gemma-3-270m-it's tokenizer_config.json): the system message
    /// is folded into the first user turn, the assistant is called "model", turns close with
    /// `<end_of_turn>` (which gen stops at, see `Tokenizer::eos_ids`).
    const GEMMA3: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

    #[test]
    fn gemma3_folds_the_system_message_into_the_first_user_turn() {
        let t = ChatTemplate::new(GEMMA3.into(), "<bos>".into(), "<eos>".into());
        let out = t
            .render(&one_shot(Some("Answer in French."), " Hi there \n"), true)
            .unwrap();
        assert_eq!(
            out,
            "<bos><start_of_turn>user\nAnswer in French.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
        );
        let out = t.render(&one_shot(None, "Hi"), false).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nHi<end_of_turn>\n");
        // Two user turns in a row break the template's own rule, as an error.
        let mut two = one_shot(None, "a");
        two.extend(one_shot(None, "b"));
        let err = t.render(&two, true).unwrap_err();
        assert!(format!("{err:#}").contains("must alternate"), "{err:#}");
    }
}
