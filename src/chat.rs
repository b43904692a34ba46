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
}
