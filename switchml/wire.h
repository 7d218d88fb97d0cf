/* The datagram format, for the C cores: the switch's data plane (switch/) and the
 * worker's engine (worker/).  wire.py is the definition; every constant here has
 * its twin there (quant.py for the exponents) under the name less WIRE_, and
 * tests/test_wire_header.py checks they agree.  Little-endian fields (wire.HEADER): magic u16, version u8, kind u8,
 * dtype u8, mode u8, slot u16, session u32, msg u32, seq u32, pkt_id u32,
 * count u16, lanes u16, call u32; then the lane records (pos u32, nxt u32, exp i16,
 * flag u16), then the values. */
#ifndef SWITCHML_WIRE_H
#define SWITCHML_WIRE_H

#define WIRE_HEADER_SIZE 32
#define WIRE_LANE_SIZE 12
#define WIRE_MAGIC 0x4D53
#define WIRE_VERSION 5
#define WIRE_KIND_CONTRIBUTION 1
#define WIRE_KIND_RESULT 2
#define WIRE_KIND_PROBE 3  /* a retransmission as the header alone */
#define WIRE_KIND_RESEND 4 /* the answer to a probe whose contribution is missing */
#define WIRE_KIND_QUERY 5  /* the timer's probe */
#define WIRE_KIND_DONE 6   /* the answer to a query of a complete set */
#define WIRE_DTYPE_INT32 0
#define WIRE_DTYPE_FLOAT32 1
#define WIRE_DTYPE_FLOAT16_WIRE 2 /* two biased 16-bit values a 32-bit word */
#define WIRE_MODE_SPARSE 1
#define WIRE_MODE_SEED 2
#define WIRE_MODE_MAX 4 /* values maxed, not added: sparse exponent rounds */
#define WIRE_FLAG_BLOCK 1
#define WIRE_POS_END 0xFFFFFFFFu
#define WIRE_CALL_SPARSE 0x80000000u
/* a lane's exponent: no value (quant.EXP_ZERO), or an inf or NaN (quant.EXP_NONFINITE) */
#define WIRE_EXP_ZERO (-32768)
#define WIRE_EXP_NONFINITE 32767

#endif
