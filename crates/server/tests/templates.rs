//! The render budget against real conversations: chat templates in the shape of Granite 4.0,
//! Nemotron-H, Jamba and ChatML (tests/templates/*.jinja, written for these tests) render a
//! conversation of 100 messages, with tools and documents, in well under a twentieth of the
//! fuel and bytes every render is given. What they take is printed (`--nocapture`); the
//! budget's doc and docs/server.md quote it.

use picaso_server::render::{render_counted, Budget};
use serde_json::{json, Value};

/// 100 messages: a system prompt, then user and assistant turns (every tenth assistant turn
/// calls a tool, answered by a tool message), each about 300 bytes.
fn conversation(with_tools: bool) -> Vec<Value> {
    let text = "The river flows through the valley and into the sea, past farms and small towns. ".repeat(4);
    let mut messages = vec![json!({"role": "system", "content": "You are a careful assistant. /think"})];
    let mut i = 0;
    while messages.len() < 100 {
        messages.push(json!({"role": "user", "content": format!("Question {i}: {text}")}));
        if with_tools && i % 10 == 9 {
            messages.push(json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": format!("call{i}"), "type": "function",
                 "function": {"name": "search", "arguments": "{\"query\": \"rivers\"}"}}]}));
            messages.push(json!({"role": "tool", "content": format!("Result {i}: {text}")}));
            messages.push(json!({"role": "user", "content": "Go on."}));
        }
        messages.push(json!({"role": "assistant", "content": format!("<think>why</think>Answer {i}: {text}")}));
        i += 1;
    }
    messages
}

fn tools() -> Value {
    let tool = |name: &str| {
        json!({"type": "function", "function": {"name": name, "description": "Looks things up.",
               "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}})
    };
    json!([tool("search"), tool("weather"), tool("calculator")])
}

fn documents() -> Value {
    json!([{"doc_id": 1, "text": "Rivers flow to the sea."}, {"doc_id": 2, "text": "Valleys hold farms."}])
}

#[test]
fn real_templates_render_100_messages_well_within_the_budget() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/templates");
    // Jamba's template refuses a tool turn between user turns as Jamba's does; it gets a
    // conversation without tools.
    for (name, tools_in_turns) in [("chatml", true), ("granite", true), ("nemotron", true), ("jamba", false)] {
        let source = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
        let messages = conversation(tools_in_turns);
        assert!(messages.len() >= 100);
        let context = json!({
            "messages": messages, "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>",
            "tools": tools(), "documents": documents(),
        });
        let budget = Budget::default();
        let (text, fuel) = render_counted(&source, &context, budget).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name}: {fuel} instructions, {} bytes at {} messages", text.len(), messages.len());
        assert!(text.contains("Question 40"), "{name}: {}", &text[..200]);
        assert!(fuel > 0 && fuel * 20 <= budget.fuel, "{name}: {fuel} of {} fuel", budget.fuel);
        assert!(text.len() * 20 <= budget.max_bytes, "{name}: {} bytes", text.len());
    }
}
