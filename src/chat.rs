//! Chat prompts: render the model's own chat template (Jinja, from the GGUF metadata or a
//! tokenizer_config.json) into the text the model was trained on.
//!
//! A template is code that came with a file from a stranger: rendering runs on a fuel budget
//! and a bounded recursion depth, so a template that loops forever fails with an error.

use anyhow::{Context, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// Enough for any real template over a long conversation; a runaway loop exhausts it quickly.
const TEMPLATE_FUEL: u64 = 2_000_000;

#[derive(Debug, Clone, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A chat template with the special tokens it may refer to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> Self {
        Self {
            source,
            bos_token,
            eos_token,
        }
    }

    /// Render `messages` and, with `add_generation_prompt`, the opening of the assistant's turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(64);
        // Templates written for Python's Jinja call str methods such as .strip() and .startswith().
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source)
            .context("the model's chat template does not parse")?;
        let tmpl = env.get_template("chat")?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| anyhow::anyhow!("rendering the model's chat template failed: {e}"))
    }
}

/// The conversation for a one-shot prompt: an optional system message, then the user's text.
pub fn one_shot(system: Option<&str>, user: &str) -> Vec<Message> {
    let mut m = Vec::new();
    if let Some(s) = system {
        m.push(Message {
            role: "system".into(),
            content: s.into(),
        });
    }
    m.push(Message {
        role: "user".into(),
        content: user.into(),
    });
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
