//! GBNF grammars against llama.cpp's own grammar tests: every `test_grammar(...)` case of
//! tests/test-grammar-integration.cpp in the llama.cpp tree .ci/llama-server builds (llama.cpp
//! 0c1e57098), read from that file as it is: each grammar is given to gen as GBNF, and each of
//! its passing strings must be taken whole by gen's grammar engine and each failing string must
//! not. Cases written with token references (`<[10]>`, `token(10)`) name ids of one vocabulary,
//! which gen refuses in one line; they are counted, not skipped silently. Then every grammar of
//! llama.cpp's grammars/ folder compiles, and one drives the default model through the binary.

mod common;

use gen::constraint::{accepts, Spec};

/// One `test_grammar` case: its description, grammar, passing and failing strings.
struct Case {
    desc: String,
    grammar: String,
    pass: Vec<String>,
    fail: Vec<String>,
}

/// What a C++ argument list holds, as far as these tests write it.
#[derive(Debug, Clone)]
enum Tok {
    Str(String),
    Open,
    Close,
    Comma,
    /// Anything else (`token(10) + ...`): the case is not plain text.
    Other,
}

/// The string literals and punctuation of C++ source from `src` until the `)` that closes the
/// call, with adjacent literals joined; the index after it.
fn tokens(src: &str) -> (Vec<Tok>, usize) {
    let b = src.as_bytes();
    let mut out: Vec<Tok> = Vec::new();
    let (mut i, mut depth) = (0, 0i32);
    while i < b.len() {
        let rest = &src[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("R\"") {
            let open = rest.find('(').unwrap();
            let delim = format!("){}\"", &rest[2..open]);
            let end = rest[open..].find(&delim).unwrap() + open;
            push_str(&mut out, rest[open + 1..end].to_string());
            i += end + delim.len();
        } else if rest.starts_with('"') {
            let (s, n) = c_string(rest);
            push_str(&mut out, s);
            i += n;
        } else {
            let c = b[i] as char;
            i += 1;
            match c {
                '{' => out.push(Tok::Open),
                '}' => out.push(Tok::Close),
                ',' => out.push(Tok::Comma),
                '(' => {
                    depth += 1;
                    out.push(Tok::Other);
                }
                ')' if depth == 0 => return (out, i),
                ')' => depth -= 1,
                c if c.is_whitespace() => {}
                _ => out.push(Tok::Other),
            }
        }
    }
    panic!("a test_grammar call is not closed");
}

fn push_str(out: &mut Vec<Tok>, s: String) {
    if let Some(Tok::Str(prev)) = out.last_mut() {
        prev.push_str(&s);
    } else {
        out.push(Tok::Str(s));
    }
}

/// A C++ `"..."` literal at the start of `s` with its escapes read; its text and length.
fn c_string(s: &str) -> (String, usize) {
    let mut out = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (out, i + 1),
            '\\' => {
                let (_, e) = chars.next().unwrap();
                out.push(match e {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    '0' => '\0',
                    other => other,
                });
            }
            c => out.push(c),
        }
    }
    panic!("an unclosed C++ string");
}

/// Every `test_grammar(` call of the file: the plain-text ones as cases, and how many were not.
fn cases(src: &str) -> (Vec<Case>, usize) {
    let (mut cases, mut not_text) = (Vec::new(), 0);
    let mut at = 0;
    while let Some(k) = src[at..].find("test_grammar(") {
        let start = at + k + "test_grammar(".len();
        if src[..at + k].ends_with("void ") {
            at = start; // the definition, not a call
            continue;
        }
        let (toks, n) = tokens(&src[start..]);
        at = start + n;
        let lists = split_args(&toks);
        match lists {
            Some((desc, grammar, pass, fail)) => cases.push(Case {
                desc,
                grammar,
                pass,
                fail,
            }),
            None => not_text += 1,
        }
    }
    (cases, not_text)
}

type Args = (String, String, Vec<String>, Vec<String>);

/// `"desc", "grammar", { strings }, { strings }`, or None when anything is not a literal.
fn split_args(toks: &[Tok]) -> Option<Args> {
    let mut it = toks.iter();
    let string = |it: &mut std::slice::Iter<Tok>| match it.next() {
        Some(Tok::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let desc = string(&mut it)?;
    matches!(it.next(), Some(Tok::Comma)).then_some(())?;
    let grammar = string(&mut it)?;
    let mut lists = Vec::new();
    for _ in 0..2 {
        matches!(it.next(), Some(Tok::Comma)).then_some(())?;
        matches!(it.next(), Some(Tok::Open)).then_some(())?;
        let mut list = Vec::new();
        loop {
            match it.next()? {
                Tok::Str(s) => list.push(s.clone()),
                Tok::Comma => {}
                Tok::Close => break,
                _ => return None,
            }
        }
        lists.push(list);
    }
    let fail = lists.pop()?;
    let pass = lists.pop()?;
    Some((desc, grammar, pass, fail))
}

#[test]
fn llama_cpps_grammar_tests_pass_and_fail_the_same_strings() {
    let file = common::llama_cpp_tree().join("tests/test-grammar-integration.cpp");
    let src = std::fs::read_to_string(&file).unwrap();
    let (cases, not_text) = cases(&src);
    // llama.cpp 0c1e57098: 14 calls, two of them with token references.
    assert_eq!(
        (cases.len(), not_text),
        (12, 2),
        "the cases read from {}",
        file.display()
    );
    let mut checked = 0;
    for case in &cases {
        assert!(gen::gbnf::is_gbnf(&case.grammar), "{}", case.desc);
        let spec = Spec::Grammar(case.grammar.clone());
        spec.check()
            .unwrap_or_else(|e| panic!("{}: {e:#}\n{}", case.desc, case.grammar));
        for s in &case.pass {
            assert!(
                accepts(&spec, s.as_bytes()).unwrap(),
                "{}: {s:?} must pass\n{}",
                case.desc,
                case.grammar
            );
        }
        for s in &case.fail {
            assert!(
                !accepts(&spec, s.as_bytes()).unwrap(),
                "{}: {s:?} must fail\n{}",
                case.desc,
                case.grammar
            );
        }
        checked += case.pass.len() + case.fail.len();
    }
    assert_eq!(checked, 119, "strings checked");
    // The two with token references are refused in one line, naming why.
    let tokens = src.matches("<[1").count();
    assert!(tokens > 0);
    let e = Spec::Grammar("root ::= <[10]> \"a\"".into())
        .check()
        .unwrap_err();
    assert!(format!("{e:#}").contains("token references"), "{e:#}");
}

#[test]
fn llama_cpps_grammar_files_compile_and_hold_a_real_reply() {
    let dir = common::llama_cpp_tree().join("grammars");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "gbnf") {
            let text = std::fs::read_to_string(&path).unwrap();
            Spec::Grammar(text)
                .check()
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 8, "{n} grammar files in {}", dir.display());

    // json_arr.gbnf through the binary, as a llama.cpp user runs it: --grammar-file.
    let file = dir.join("json_arr.gbnf");
    let out = common::gen()
        .arg("--model")
        .arg(common::smollm2())
        .args([
            "-p",
            "A JSON list of three numbers:",
            "-n",
            "60",
            "-t",
            "0",
            "-q",
        ])
        .arg("--grammar-file")
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let reply = common::text(&out.stdout);
    let v: serde_json::Value =
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{reply:?}: {e}"));
    assert!(v.is_array(), "{reply}");
    // Inline GBNF, as llama.cpp's --grammar takes it.
    let out = common::gen()
        .arg("--model")
        .arg(common::smollm2())
        .args(["-p", "Is the sky blue? Answer:", "-n", "8", "-t", "0", "-q"])
        .args(["--grammar", r#"root ::= " " ("yes" | "no")"#])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::text(&out.stderr));
    let reply = common::text(&out.stdout);
    assert!(reply == " yes" || reply == " no", "{reply:?}");
}
