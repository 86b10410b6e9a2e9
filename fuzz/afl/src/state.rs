//! AFL++ target: the state-file reader (`picaso-state/1..3`, f32 or bf16). Reading any bytes
//! must not panic; a file that is accepted must hold finite values and survive a round trip
//! (written again and read back, the same state).

use picaso_model::{State, StateDtype};

fn main() {
    afl::fuzz!(|bytes: &[u8]| {
        let Ok(state) = State::from_bytes(bytes) else { return };
        if state.check_values().is_err() {
            return;
        }
        for dtype in [StateDtype::F32, StateDtype::Bf16] {
            let again = state.to_bytes(dtype).expect("an accepted state can be written");
            let back = State::from_bytes(&again).expect("a written state can be read");
            assert_eq!(back.n_tokens, state.n_tokens, "token count lost in a round trip");
            assert_eq!(back.fingerprint, state.fingerprint, "fingerprint lost in a round trip");
            if dtype == StateDtype::F32 {
                assert_eq!(again, back.to_bytes(dtype).unwrap(), "an f32 round trip changed the file");
            }
        }
    });
}
