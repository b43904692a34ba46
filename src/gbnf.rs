//! GBNF, llama.cpp's grammar format (the one most grammar files people have are written in),
//! read and rewritten as the Lark-like grammar llguidance compiles.
//!
//! The syntax is llama.cpp's (its grammars/README.md): rules `name ::= alternatives`, string
//! literals `"..."`, character classes `[a-z]` and `[^...]`, `.` for any character, groups,
//! `* + ?` and `{m}`, `{m,}`, `{m,n}`, `{,n}`; `#` comments; a newline ends a rule except inside
//! parentheses and after `::=` or `|`; the escapes `\x`, `\u`, `\U`, `\t`, `\r`, `\n`, `\\`,
//! `\"`, `\[`, `\]`. The start is `root`; a rule defined twice keeps its last definition, as in
//! llama.cpp. Token references (`<[id]>`, `<think>`) are refused in one line: they name ids of
//! one vocabulary, not text. llguidance's Earley parser takes left recursion, which llama.cpp
//! refuses, so a few grammars llama.cpp rejects run here; none it accepts is refused.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, Result};

/// True when `text` reads as GBNF: some line defines a rule with `::=` (Lark uses `:`).
pub fn is_gbnf(text: &str) -> bool {
    text.lines().any(|l| {
        let l = l.trim_start();
        let name_end = l
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .unwrap_or(l.len());
        name_end > 0 && l[name_end..].trim_start().starts_with("::=")
    })
}

/// The same language as the GBNF `text`, in llguidance's Lark syntax; one line on error.
pub fn to_lark(text: &str) -> Result<String> {
    let rules = Parser::new(text).grammar()?;
    if !rules.contains_key("root") {
        bail!("the GBNF grammar has no `root` rule (where it starts)");
    }
    for alts in rules.values() {
        for name in refs(alts) {
            if !rules.contains_key(name) {
                bail!("the GBNF grammar uses the rule `{name}` but never defines it");
            }
        }
    }
    let names = lark_names(&rules);
    let mut out = format!("start: {}\n", names["root"]);
    for (name, alts) in &rules {
        out.push_str(&format!(
            "{}: {}\n",
            names[name.as_str()],
            alternates(alts, &names)?
        ));
    }
    Ok(out)
}

/// One element of a sequence.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Literal(String),
    /// A character class: its ranges (single characters as `(c, c)`), negated or not.
    Class(bool, Vec<(char, char)>),
    Any,
    Rule(String),
    Group(Vec<Vec<Node>>),
    /// A node repeated from `min` to `max` times (None: no limit).
    Repeat(Box<Node>, u32, Option<u32>),
}

fn refs(alts: &[Vec<Node>]) -> Vec<&str> {
    let mut out = Vec::new();
    let mut todo: Vec<&Node> = alts.iter().flatten().collect();
    while let Some(n) = todo.pop() {
        match n {
            Node::Rule(r) => out.push(r.as_str()),
            Node::Group(g) => todo.extend(g.iter().flatten()),
            Node::Repeat(inner, ..) => todo.push(inner),
            _ => {}
        }
    }
    out
}

/// Lark rule names are lower case (upper case names are lexemes) and `start` is llguidance's:
/// each GBNF name gets a lower-case one of its own.
fn lark_names(rules: &BTreeMap<String, Vec<Vec<Node>>>) -> HashMap<&str, String> {
    let mut taken = std::collections::HashSet::from(["start".to_string()]);
    let mut names = HashMap::new();
    for name in rules.keys() {
        let mut base: String = name
            .chars()
            .map(|c| match c {
                'A'..='Z' => c.to_ascii_lowercase(),
                'a'..='z' | '0'..='9' | '_' => c,
                _ => '_',
            })
            .collect();
        if !base.starts_with(|c: char| c.is_ascii_lowercase()) {
            base.insert_str(0, "r_");
        }
        let mut candidate = base.clone();
        let mut k = 1;
        while !taken.insert(candidate.clone()) {
            k += 1;
            candidate = format!("{base}_{k}");
        }
        names.insert(name.as_str(), candidate);
    }
    names
}

/// `a b | c`, with empty alternatives as an optional group (a Lark lexeme cannot be empty).
fn alternates(alts: &[Vec<Node>], names: &HashMap<&str, String>) -> Result<String> {
    let mut empty = false;
    let mut parts = Vec::new();
    for seq in alts {
        let items: Vec<String> = seq
            .iter()
            .map(|n| node(n, names))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .flatten()
            .collect();
        if items.is_empty() {
            empty = true;
        } else {
            parts.push(items.join(" "));
        }
    }
    Ok(match (parts.is_empty(), empty) {
        (true, _) => {
            bail!("a GBNF rule or group that matches only the empty string is not supported")
        }
        (false, false) => parts.join(" | "),
        (false, true) => format!("({})?", parts.join(" | ")),
    })
}

/// A node in Lark; None for one that matches only the empty string (`""`, `x{0}`).
fn node(n: &Node, names: &HashMap<&str, String>) -> Result<Option<String>> {
    Ok(Some(match n {
        Node::Literal(s) if s.is_empty() => return Ok(None),
        Node::Literal(s) => serde_json::to_string(s)?,
        Node::Any => "/(?s:.)/".to_string(),
        Node::Class(negated, ranges) => {
            let mut rx = String::from(if *negated { "/[^" } else { "/[" });
            for &(a, b) in ranges {
                rx.push_str(&format!("\\x{{{:x}}}", a as u32));
                if a != b {
                    rx.push_str(&format!("-\\x{{{:x}}}", b as u32));
                }
            }
            rx.push_str("]/");
            rx
        }
        Node::Rule(r) => names[r.as_str()].clone(),
        Node::Group(alts) => {
            let all_empty = alts
                .iter()
                .all(|s| s.iter().all(|n| node(n, names).ok().flatten().is_none()));
            if all_empty {
                return Ok(None);
            }
            format!("({})", alternates(alts, names)?)
        }
        Node::Repeat(inner, min, max) => {
            let Some(atom) = node(inner, names)? else {
                return Ok(None);
            };
            match (min, max) {
                (_, Some(0)) => return Ok(None),
                (0, None) => format!("{atom}*"),
                (1, None) => format!("{atom}+"),
                (0, Some(1)) => format!("{atom}?"),
                (m, None) => format!("{atom}{{{m},}}"),
                (m, Some(n)) => format!("{atom}{{{m},{n}}}"),
            }
        }
    }))
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn new(src: &'a str) -> Self {
        Self { src, pos: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.src[self.pos..]
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn line(&self) -> usize {
        self.src[..self.pos].matches('\n').count() + 1
    }

    fn fail<T>(&self, what: &str) -> Result<T> {
        bail!("GBNF line {}: {what}", self.line())
    }

    /// Skip spaces, tabs and comments; newlines too when `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '#' => self.pos += self.rest().find('\n').unwrap_or(self.rest().len()),
                '\r' | '\n' if newlines => self.pos += 1,
                _ => break,
            }
        }
    }

    fn word(&mut self) -> &'a str {
        let n = self
            .rest()
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .unwrap_or(self.rest().len());
        let w = &self.rest()[..n];
        self.pos += n;
        w
    }

    fn grammar(&mut self) -> Result<BTreeMap<String, Vec<Vec<Node>>>> {
        let mut rules = BTreeMap::new();
        self.space(true);
        while self.peek().is_some() {
            let name = self.word();
            if name.is_empty() {
                return self.fail(&format!(
                    "expected a rule name, found {:?}",
                    self.peek().unwrap()
                ));
            }
            self.space(false);
            if !self.rest().starts_with("::=") {
                return self.fail(&format!("expected ::= after `{name}`"));
            }
            self.pos += 3;
            self.space(true);
            let alts = self.alternates(false)?;
            match self.peek() {
                None | Some('\n' | '\r') => {}
                Some(c) => return self.fail(&format!("unexpected {c:?} in rule `{name}`")),
            }
            rules.insert(name.to_string(), alts);
            self.space(true);
        }
        Ok(rules)
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Node>>> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.pos += 1;
            self.space(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    fn sequence(&mut self, nested: bool) -> Result<Vec<Node>> {
        let mut seq: Vec<Node> = Vec::new();
        while let Some(c) = self.peek() {
            let item = match c {
                '"' => {
                    self.pos += 1;
                    Node::Literal(self.literal()?)
                }
                '[' => {
                    self.pos += 1;
                    self.class()?
                }
                '.' => {
                    self.pos += 1;
                    Node::Any
                }
                '(' => {
                    self.pos += 1;
                    self.space(true);
                    let alts = self.alternates(true)?;
                    if self.peek() != Some(')') {
                        return self.fail("expected `)`");
                    }
                    self.pos += 1;
                    Node::Group(alts)
                }
                '<' | '!' => {
                    return self.fail(
                        "token references (<[id]>, <name>) are not supported; write the text",
                    )
                }
                '*' | '+' | '?' | '{' => {
                    let Some(last) = seq.pop() else {
                        return self.fail(&format!("{c:?} with nothing before it to repeat"));
                    };
                    let (min, max) = self.repetition()?;
                    Node::Repeat(Box::new(last), min, max)
                }
                c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    Node::Rule(self.word().to_string())
                }
                _ => break,
            };
            seq.push(item);
            self.space(nested);
        }
        Ok(seq)
    }

    fn repetition(&mut self) -> Result<(u32, Option<u32>)> {
        let c = self.peek().expect("called on a repetition");
        self.pos += 1;
        Ok(match c {
            '*' => (0, None),
            '+' => (1, None),
            '?' => (0, Some(1)),
            _ => {
                self.space(false);
                let min = self.number()?.unwrap_or(0);
                self.space(false);
                let max = if self.peek() == Some(',') {
                    self.pos += 1;
                    self.space(false);
                    self.number()?
                } else {
                    Some(min)
                };
                self.space(false);
                if self.peek() != Some('}') {
                    return self.fail("expected `}` to end a repetition");
                }
                self.pos += 1;
                if max.is_some_and(|m| m < min) {
                    return self.fail(&format!(
                        "a repetition's maximum is below its minimum {min}"
                    ));
                }
                (min, max)
            }
        })
    }

    fn number(&mut self) -> Result<Option<u32>> {
        let n = self
            .rest()
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(self.rest().len());
        if n == 0 {
            return Ok(None);
        }
        let digits = &self.rest()[..n];
        self.pos += n;
        match digits.parse() {
            Ok(v) => Ok(Some(v)),
            Err(_) => self.fail(&format!("the repetition count {digits} is too large")),
        }
    }

    fn literal(&mut self) -> Result<String> {
        let mut s = String::new();
        loop {
            match self.peek() {
                None | Some('\n') => return self.fail("a string literal is not closed"),
                Some('"') => {
                    self.pos += 1;
                    return Ok(s);
                }
                Some(_) => s.push(self.char()?),
            }
        }
    }

    fn class(&mut self) -> Result<Node> {
        let negated = self.peek() == Some('^');
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return self.fail("a character class is not closed"),
                Some(']') => {
                    self.pos += 1;
                    return Ok(Node::Class(negated, ranges));
                }
                Some(_) => {
                    let a = self.char()?;
                    let b = if self.rest().starts_with('-') && !self.rest()[1..].starts_with(']') {
                        self.pos += 1;
                        if self.peek().is_none() {
                            return self.fail("a character class is not closed");
                        }
                        self.char()?
                    } else {
                        a
                    };
                    if b < a {
                        return self.fail(&format!("the range {a:?}-{b:?} is backwards"));
                    }
                    ranges.push((a, b));
                }
            }
        }
    }

    /// One character of a literal or class, escapes read.
    fn char(&mut self) -> Result<char> {
        let c = self.peek().expect("called with input left");
        self.pos += c.len_utf8();
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else {
            return self.fail("a backslash ends the grammar");
        };
        self.pos += e.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Result<char> {
            let digits = p.rest().get(..n).unwrap_or("");
            let v = u32::from_str_radix(digits, 16)
                .ok()
                .filter(|_| digits.len() == n);
            p.pos += digits.len();
            match v.and_then(char::from_u32) {
                Some(c) => Ok(c),
                None => p.fail(&format!("\\{e} needs {n} hex digits of a character")),
            }
        };
        Ok(match e {
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            't' => '\t',
            'r' => '\r',
            'n' => '\n',
            '\\' | '"' | '[' | ']' => e,
            _ => return self.fail(&format!("unknown escape \\{e}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_rules_classes_repetitions_and_names() {
        let g = "root ::= item (\",\" ws item){0,3}  # a list\nitem ::= [a-z0-9_-]+ | \"\\\"q\\\"\"\nws ::= | \" \"\nStart-Here ::= .\n";
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "start: root\n\
             start_here: /(?s:.)/\n\
             item: /[\\x{61}-\\x{7a}\\x{30}-\\x{39}\\x{5f}\\x{2d}]/+ | \"\\\"q\\\"\"\n\
             root: item (\",\" ws item){0,3}\n\
             ws: (\" \")?\n"
        );
    }

    #[test]
    fn detects_the_format() {
        assert!(is_gbnf("# c\nroot ::= \"a\""));
        assert!(is_gbnf("  my-rule::=x"));
        assert!(!is_gbnf("start: \"a\" | \"b\"\n"));
        assert!(!is_gbnf("start: \"::=\"\n"));
    }

    #[test]
    fn newlines_end_rules_except_where_llama_cpp_continues_them() {
        let g = "root ::=\n  \"a\" (\n  \"b\"\n  | \"c\") |\n  \"d\"\n";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: root\nroot: \"a\" (\"b\" | \"c\") | \"d\"\n"
        );
        // A newline at the top level ends the rule: the next line must be a rule.
        let e = to_lark("root ::= \"a\"\n  \"b\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn refuses_in_one_line() {
        for (g, says) in [
            ("item ::= \"a\"", "no `root`"),
            ("root ::= other", "`other` but never defines"),
            ("root ::= <[10]>", "token references"),
            ("root ::= \"a", "not closed"),
            ("root ::= [a-", "not closed"),
            ("root ::= \"\\q\"", "unknown escape \\q"),
            ("root ::= \"a\"{3,1}", "below its minimum"),
            ("root ::= * \"a\"", "nothing before it"),
            ("root = \"a\"", "expected ::="),
            ("root ::= \"\"", "only the empty string"),
        ] {
            let e = format!("{:#}", to_lark(g).unwrap_err());
            assert!(e.contains(says), "{g}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
